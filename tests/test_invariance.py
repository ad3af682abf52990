"""Scheduling must not change results (issue 3, "Engine core").

A request's greedy output is the same whether it runs alone or batched with 31 others, with prefill split
into chunks by a small token budget, with another block size, with prefix caching on or off, and when a
tiny KV pool forces preemption. After all that, every block is back in the free pool.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import metric_values, random_prompts, staggered_greedy_requests

from pagedllm import LLM, SamplingParams

NUM_PROMPTS = 32
MAX_TOKENS = 12
MAX_MODEL_LEN = 256
VOCAB = 512  # tiny_llama_dir's BPE vocabulary

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    """Mixed lengths, several sharing a 40-token prefix so prefix caching has something to reuse."""
    prompts = random_prompts(NUM_PROMPTS - 8, VOCAB, seed=3)
    shared = random_prompts(1, VOCAB, [40], seed=4)[0]
    suffixes = random_prompts(8, VOCAB, [0, 1, 5, 8, 16, 24, 33, 70], seed=5)
    return prompts + [shared + s for s in suffixes]


PROMPTS = make_prompts()


def token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts, "outputs must come back in prompt order"
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    metrics = metric_values(llm)
    # Prefix-cached blocks sit in the free queue and count as free.
    assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
    assert metrics["pagedllm:num_requests_running"] == 0
    assert metrics["pagedllm:num_requests_waiting"] == 0


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> list[list[int]]:
    """Each prompt alone, prefix caching off: nothing shared, nothing chunked."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN)
    want = [token_ids(llm, [p])[0] for p in PROMPTS]
    assert all(len(t) == MAX_TOKENS for t in want)
    assert_no_leaks(llm)
    return want


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param(dict(), id="batch32"),
        pytest.param(dict(max_num_batched_tokens=32, max_num_seqs=8), id="chunked_prefill_budget32"),
        pytest.param(dict(max_num_batched_tokens=7, max_num_seqs=3), id="chunked_prefill_budget7"),
        pytest.param(dict(block_size=32), id="block32"),
        pytest.param(dict(block_size=16, enable_prefix_caching=False), id="no_prefix_caching"),
        pytest.param(dict(scheduling_policy="lpm"), id="lpm"),
    ],
)
def test_batched_output_equals_alone(tiny_llama_dir: str, reference: list[list[int]], engine_args: dict) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, **engine_args)
    assert token_ids(llm, PROMPTS) == reference
    assert_no_leaks(llm)


def test_prefix_cache_hits_do_not_change_output(tiny_llama_dir: str, reference: list[list[int]]) -> None:
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
    )
    assert token_ids(llm, PROMPTS) == reference
    hits_before = metric_values(llm)["pagedllm:prefix_cache_hits"]
    # Second pass: every full block of every prompt is cached now, in a different batch order.
    order = list(reversed(range(NUM_PROMPTS)))
    again = token_ids(llm, [PROMPTS[i] for i in order])
    assert again == [reference[i] for i in order]
    metrics = metric_values(llm)
    assert metrics["pagedllm:prefix_cache_hits"] > hits_before
    assert metrics["pagedllm:prefix_cache_queries"] >= metrics["pagedllm:prefix_cache_hits"]
    assert_no_leaks(llm)
    # A prompt whose every token is cached (a block-aligned prompt seen before) still works.
    aligned = PROMPTS[-8][:32]
    first = token_ids(llm, [aligned])
    assert token_ids(llm, [aligned]) == first
    llm.reset_prefix_cache()
    assert token_ids(llm, [aligned]) == first
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_preemption_keeps_outputs(tiny_llama_dir: str, reference: list[list[int]], prefix_caching: bool) -> None:
    block_size = 16
    # The longest request needs ceil((longest prompt + MAX_TOKENS) / 16) blocks; give a few more.
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    num_blocks = -(-longest // block_size) + 3
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=prefix_caching,
    )
    metrics = metric_values(llm)
    # An engine may keep one block aside (vLLM's null block); the rest is the pool we asked for.
    assert num_blocks - 1 <= metrics["pagedllm:kv_cache_total_blocks"] <= num_blocks
    assert token_ids(llm, PROMPTS) == reference
    metrics = metric_values(llm)
    assert metrics["pagedllm:num_preemptions"] > 0, "the pool is too small for all requests at once"
    assert_no_leaks(llm)


def sampled_params() -> list[SamplingParams]:
    """One seeded sampling request per prompt, with every filter in play."""
    return [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(NUM_PROMPTS)
    ]


def sampled_ids(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, sampled_params(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def sampled_reference(tiny_llama_dir: str) -> list[list[int]]:
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN)
    return [
        list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p, sp in zip(PROMPTS, sampled_params())
    ]


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param(dict(), id="batch32"),
        pytest.param(dict(max_num_batched_tokens=7, max_num_seqs=3), id="chunked_prefill_budget7"),
        pytest.param(dict(block_size=16, num_gpu_blocks_override=11), id="preemption"),
    ],
)
def test_seeded_sampling_invariant_to_scheduling(
    tiny_llama_dir: str, sampled_reference: list[list[int]], engine_args: dict
) -> None:
    """A seeded request's generator advances once per sampled token: not per prefill chunk, not on the
    recompute after a preemption, and not because other requests share the batch."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, **engine_args)
    assert sampled_ids(llm) == sampled_reference
    if "num_gpu_blocks_override" in engine_args:
        assert metric_values(llm)["pagedllm:num_preemptions"] > 0
    assert_no_leaks(llm)


def test_prompt_logprobs_with_prefix_cache_hit(tiny_llama_dir: str) -> None:
    """A cached prefix must not leave holes in prompt_logprobs (its logits were never kept)."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
    prompt = PROMPTS[-1]  # 40-token shared prefix + 70
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    llm.generate([PROMPTS[-2]], GREEDY, use_tqdm=False)  # caches the shared prefix
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    second = llm.generate([prompt], sp, use_tqdm=False)[0]
    for out in (first, second):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None and all(e is not None for e in out.prompt_logprobs[1:])
    for pos in range(1, len(prompt)):
        a, b = first.prompt_logprobs[pos], second.prompt_logprobs[pos]
        assert a[prompt[pos]].logprob == pytest.approx(b[prompt[pos]].logprob, abs=1e-5), pos
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert_no_leaks(llm)


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    subset=st.lists(st.integers(0, NUM_PROMPTS - 1), min_size=1, max_size=10, unique=True),
    block_size=st.sampled_from([8, 16, 32]),
    max_num_batched_tokens=st.integers(4, 96),
    max_num_seqs=st.integers(1, 8),
    enable_prefix_caching=st.booleans(),
    spare_blocks=st.one_of(st.none(), st.integers(0, 6)),
)
def test_random_engine_configs_keep_outputs(
    tiny_llama_dir: str,
    reference: list[list[int]],
    subset: list[int],
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    enable_prefix_caching: bool,
    spare_blocks: int | None,
) -> None:
    """Any mix of block size, token budget, sequence cap, caching and (tight) pool size, in any order."""
    prompts = [PROMPTS[i] for i in subset]
    num_blocks = None
    if spare_blocks is not None:
        need = max(-(-(len(p) + MAX_TOKENS) // block_size) for p in prompts)
        num_blocks = need + 1 + spare_blocks  # +1 in case the engine keeps a null block aside
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_blocks,
    )
    assert token_ids(llm, prompts) == [reference[i] for i in subset]
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_logprobs_survive_preemption(tiny_llama_dir: str, prefix_caching: bool) -> None:
    """A preempted request is recomputed: its logprobs and prompt_logprobs are neither lost nor doubled."""
    prompts = PROMPTS[:12]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    roomy = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    want = roomy.generate(prompts, sp, use_tqdm=False)
    need = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)
    tight = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=need + 2,
        enable_prefix_caching=prefix_caching,
    )
    got = tight.generate(prompts, sp, use_tqdm=False)
    assert metric_values(tight)["pagedllm:num_preemptions"] > 0
    for prompt, a, b in zip(prompts, got, want):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert len(ca.logprobs) == len(ca.token_ids)
        for ea, eb in zip(ca.logprobs, cb.logprobs):
            assert ea.keys() == eb.keys()
            for t in ea:
                assert ea[t].logprob == pytest.approx(eb[t].logprob, abs=1e-5)
        assert len(a.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            t = prompt[pos]
            assert a.prompt_logprobs[pos][t].logprob == pytest.approx(b.prompt_logprobs[pos][t].logprob, abs=1e-5)
    assert_no_leaks(tight)


@pytest.mark.parametrize("num_blocks,sampling", [(None, "greedy"), (7, "greedy"), (None, "sampled")],
                         ids=["plenty", "preempting", "sampled"])
def test_input_batch_rows_keep_each_requests_output(tiny_llama_dir: str, num_blocks: int | None,
                                                    sampling: str) -> None:
    """The worker's persistent batch (worker/input_batch.py) through requests that end at different steps,
    by length and by stop token, whose rows are then reused by later ones, with 4 rows for 10 requests,
    and, with few blocks, preempted ones that keep their rows: each request's tokens equal its tokens
    alone. Sampled: greedy rows beside seeded rows with logprobs and penalties (the argmax rows and the
    sampler's in one step)."""
    inputs, params = staggered_greedy_requests(VOCAB)
    if sampling == "sampled":
        params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.8, seed=i, max_tokens=p.max_tokens,
                                 ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids,
                                 logprobs=2 if i % 3 == 1 else None, repetition_penalty=1.2 if i % 5 == 2 else 1.0)
                  for i, p in enumerate(params)]
    kwargs = dict(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    alone = LLM(**kwargs)
    want = [list(alone.generate([i], p, use_tqdm=False)[0].outputs[0].token_ids) for i, p in zip(inputs, params)]
    llm = LLM(**kwargs, max_num_seqs=4, num_gpu_blocks_override=num_blocks)
    got = [list(out.outputs[0].token_ids) for out in llm.generate(inputs, params, use_tqdm=False)]
    assert got == want
    if num_blocks is not None:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)
    assert not llm.llm_engine.model_runner.input_batch.requests

