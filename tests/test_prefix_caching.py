"""Prefix caching and copy-on-write block sharing through the whole engine (issue 4).

What is shown here, on tiny random models:
- outputs are the same with caching on and off (greedy and seeded sampling; prefixes shared at
  block-aligned and unaligned lengths; chunked prefill on and off; the cache warm and cold);
- 50 requests with one 4,000-token prefix hold the prefix's blocks once, and compute it once;
- a request sent again computes only what is past its last full cached block (one token when its
  length is one past a block boundary);
- under memory pressure cached blocks are evicted least recently used first (a request's tail first),
  and outputs stay correct;
- parallel sampling (n > 1) shares the prompt's blocks and copies the shared partial block on write;
  its seeded samples equal separate requests with seeds seed, seed+1, ...;
- the `lpm` policy gives the same outputs as `fcfs` and admits the longest cached prefix first;
- `reset_prefix_cache()` empties the cache when idle and refuses while requests hold blocks.

The invariants of the block pool itself under random operations live in test_kv_cache_property.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from tiny_models import build_model, metric_values, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.core_types.scheduler_output import SchedulerOutput
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_cache.hashing import extend_block_hashes
from pagedllm.kv_cache.manager import cdiv

VOCAB = 512  # the BPE vocabulary of tiny_models.build_model
BLOCK = 16
MAX_MODEL_LEN = 512


def make_llm(model: str, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("block_size", BLOCK)
    return LLM(model=model, **kwargs)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.pool.num_blocks, "blocks leaked"
    assert not engine.kv_cache_manager.req_to_blocks


@contextmanager
def recording(engine: LLMEngine) -> Iterator[list[SchedulerOutput]]:
    """Record every SchedulerOutput (tokens computed, block copies) without changing behaviour."""
    outputs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def wrapped() -> SchedulerOutput:
        out = schedule()
        outputs.append(out)
        return out

    engine.scheduler.schedule = wrapped  # type: ignore[method-assign]
    try:
        yield outputs
    finally:
        del engine.scheduler.schedule


def num_computed(outputs: list[SchedulerOutput]) -> int:
    return sum(out.num_batched_tokens for out in outputs)


def held_blocks(engine: LLMEngine) -> set[int]:
    """Physical blocks held by some request right now (each counted once, however many share it)."""
    return {b.block_id for blocks in engine.kv_cache_manager.req_to_blocks.values() for b in blocks}


# ---- outputs identical with caching on and off ----

def shared_prefix_prompts() -> list[list[int]]:
    """Prompts sharing a 32-token (block-aligned) and a 37-token (unaligned) prefix, with suffixes that
    end before, at and after block boundaries; a prompt equal to its prefix; exact duplicates; and a
    few unrelated prompts."""
    aligned, unaligned = random_prompts(2, VOCAB, [32, 37], seed=11)
    suffixes = random_prompts(5, VOCAB, [0, 1, 5, 16, 27], seed=12)
    prompts = [aligned + s for s in suffixes] + [unaligned + s for s in suffixes]
    prompts += [aligned + suffixes[3], unaligned + suffixes[2]]  # duplicates in the same batch
    prompts += random_prompts(3, VOCAB, [15, 33, 48], seed=13)
    return prompts


PROMPTS = shared_prefix_prompts()
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.0, top_k=50, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def uncached(tiny_llama_dir: str) -> dict[str, list[list[int]]]:
    """Caching off, each prompt alone: the reference."""
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    want = {
        "greedy": [run(llm, [p], GREEDY)[0] for p in PROMPTS],
        "seeded": [run(llm, [p], s)[0] for p, s in zip(PROMPTS, SEEDED)],
    }
    assert metric_values(llm)["pagedllm:prefix_cache_hits"] == 0
    return want


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_outputs_identical_with_caching_on_and_off(tiny_llama_dir: str, uncached: dict, sampling: str,
                                                   chunked: bool) -> None:
    # A 24-token budget ends prefill chunks in the middle of blocks; unchunked needs max_model_len.
    budget = 24 if chunked else MAX_MODEL_LEN
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=True, enable_chunked_prefill=chunked,
                   max_num_batched_tokens=budget)
    params = GREEDY if sampling == "greedy" else SEEDED
    cold = run(llm, PROMPTS, params)  # cache filled while the batch runs: hits between its requests
    hits_cold = metric_values(llm)["pagedllm:prefix_cache_hits"]
    warm = run(llm, PROMPTS, params)  # every full block of every prompt is cached now
    metrics = metric_values(llm)
    assert cold == uncached[sampling]
    assert warm == uncached[sampling]
    assert hits_cold > 0
    # Warm: each prompt hits all its full blocks short of its last token.
    assert metrics["pagedllm:prefix_cache_hits"] - hits_cold == sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
    assert_idle(llm)


# ---- 50 requests, one 4,000-token prefix ----

PREFIX_LEN = 4000  # 250 blocks of 16
QUESTION_LEN = 50
NUM_REQUESTS = 50


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random Llama with a 4,096-token context, small enough that a 4,000-token prefill is cheap."""
    return build_model(tmp_path_factory.mktemp("long_llama"), "llama", hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                       max_position_embeddings=4096, seed=2)


@pytest.mark.parametrize("budget", [8192, 1024], ids=["together", "chunked-1024"])
def test_shared_4000_token_prefix_held_once_and_computed_once(long_model_dir: str, budget: int) -> None:
    """With a budget of 8,192 tokens all 50 are admitted in the first step; with 1,024 the prefix is
    prefilled in chunks and the others join as it completes (running requests allocate, and so cache,
    their blocks before waiting ones are admitted, so none recomputes a part of the prefix)."""
    together = budget >= PREFIX_LEN + NUM_REQUESTS * QUESTION_LEN
    prefix = random_prompts(1, VOCAB, [PREFIX_LEN], seed=21)[0]
    questions = random_prompts(NUM_REQUESTS, VOCAB, [QUESTION_LEN] * NUM_REQUESTS, seed=22)
    prompts = [prefix + q for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prefix_blocks = PREFIX_LEN // BLOCK
    own_blocks = cdiv(PREFIX_LEN + QUESTION_LEN + 1, BLOCK) - prefix_blocks  # question + first output
    llm = make_llm(long_model_dir, max_model_len=4096, max_num_batched_tokens=budget, max_num_seqs=NUM_REQUESTS,
                   num_gpu_blocks_override=prefix_blocks + NUM_REQUESTS * own_blocks + 16)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)

    outputs: dict[str, list[int]] = {}
    max_held = 0
    shared_part_entries = shared_part_blocks = 0
    with recording(engine) as scheduled:
        first = True
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            held = held_blocks(engine)
            # The pool's usage counts a shared block once: it is exactly the set of held blocks.
            assert kv.pool.num_blocks - kv.num_free_blocks == len(held)
            assert metric_values(llm)["pagedllm:kv_cache_usage_perc"] == pytest.approx(len(held) / kv.pool.num_blocks)
            max_held = max(max_held, len(held))
            if first and together:
                tables = list(kv.req_to_blocks.values())
                assert len(tables) == NUM_REQUESTS, "all 50 requests must be admitted together"
                shared_part = [b.block_id for t in tables for b in t[:prefix_blocks]]
                shared_part_entries, shared_part_blocks = len(shared_part), len(set(shared_part))
                first = False

    # Held at once: the prefix's blocks once, plus each request's own.
    assert max_held <= prefix_blocks + NUM_REQUESTS * own_blocks
    if together:
        assert shared_part_entries == NUM_REQUESTS * prefix_blocks
        assert shared_part_blocks == prefix_blocks
        saving = 1 - shared_part_blocks / shared_part_entries
        assert saving >= 0.97, f"saving on the shared part {saving:.3f}"

    # Computed once: one full prompt, then only each other request's question, then one decode each.
    metrics = metric_values(llm)
    assert metrics["pagedllm:prefix_cache_queries"] == NUM_REQUESTS * (PREFIX_LEN + QUESTION_LEN)
    assert metrics["pagedllm:prefix_cache_hits"] == (NUM_REQUESTS - 1) * PREFIX_LEN
    assert num_computed(scheduled) == PREFIX_LEN + NUM_REQUESTS * QUESTION_LEN + NUM_REQUESTS
    assert metrics["pagedllm:num_cached_blocks"] >= prefix_blocks
    assert_idle(llm)

    if not together:
        return
    # Correct too: a few of them alone, without caching.
    reference = make_llm(long_model_dir, max_model_len=4096, max_num_batched_tokens=8192,
                         enable_prefix_caching=False, num_gpu_blocks_override=300)
    for i in (0, 1, NUM_REQUESTS - 1):
        assert run(reference, [prompts[i]], params)[0] == outputs[str(i)]


# ---- sent again: only the last token is computed ----

@pytest.mark.parametrize("prompt_len", [6 * BLOCK + 1, 6 * BLOCK + 4, 6 * BLOCK])
def test_resent_request_computes_only_past_its_cached_blocks(tiny_llama_dir: str, prompt_len: int) -> None:
    llm = make_llm(tiny_llama_dir)
    prompt = random_prompts(1, VOCAB, [prompt_len], seed=31)[0]
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    with recording(llm.llm_engine) as scheduled:
        again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Full blocks are cached; the last prompt token is always computed (its logits are needed).
    num_cached = (prompt_len - 1) // BLOCK * BLOCK
    assert again.num_cached_tokens == num_cached
    prefill = scheduled[0].scheduled[0]
    assert (prefill.start_pos, prefill.num_new_tokens) == (num_cached, prompt_len - num_cached)
    if prompt_len % BLOCK == 1:
        assert prefill.num_new_tokens == 1
    assert num_computed(scheduled) == prompt_len - num_cached + MAX_TOKENS - 1
    assert_idle(llm)


# ---- eviction under memory pressure ----

def cached_tokens(llm: LLM, prompt: list[int]) -> int:
    return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0),
                        use_tqdm=False)[0].num_cached_tokens


def cached_blocks(llm: LLM, prompt: list[int]) -> list[bool]:
    """For each full block of `prompt`: is it in the prefix cache? (Looks only; changes no LRU order.)"""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, BLOCK)
    pool = llm.llm_engine.kv_cache_manager.pool
    return [pool.get_cached_block(h) is not None for h in hashes]


def test_eviction_is_least_recently_used_first(tiny_llama_dir: str) -> None:
    # 12 blocks: three 64-token prompts (4 blocks each, max_tokens=1) fill the pool with cached blocks.
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=12)
    pool = llm.llm_engine.kv_cache_manager.pool
    a, b, c, d = random_prompts(4, VOCAB, [64] * 4, seed=41)
    e = random_prompts(1, VOCAB, [32], seed=42)[0]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    want = {i: run(llm, [p], one)[0] for i, p in enumerate((a, b, c))}
    assert pool.num_cached_blocks == 12 and pool.num_evictions == 0
    # Use A again: its blocks become the most recently used. (Its last block is recomputed, since the
    # last prompt token always is; it takes the least recently used free block, A's own tail.)
    assert run(llm, [a], one)[0] == want[0]
    assert cached_blocks(llm, a) == [True] * 4
    # D needs 4 new blocks: B's are now the least recently used, so B goes and A and C stay.
    run(llm, [d], one)
    assert cached_blocks(llm, b) == [False] * 4
    assert cached_blocks(llm, a) == cached_blocks(llm, c) == cached_blocks(llm, d) == [True] * 4
    # C is the least recently used now; E needs 2 blocks and takes C's tail first, so C keeps its start.
    run(llm, [e], one)
    assert cached_blocks(llm, c) == [True, True, False, False]
    assert cached_blocks(llm, a) == [True] * 4
    assert pool.num_evictions == 1 + 4 + 2
    # Outputs stay correct on what is left: B from scratch, C from its first two blocks.
    assert cached_tokens(llm, c) == 2 * BLOCK
    assert run(llm, [b], one)[0] == want[1]
    assert run(llm, [c], one)[0] == want[2]
    assert_idle(llm)


def test_outputs_correct_under_memory_pressure(tiny_llama_dir: str, uncached: dict) -> None:
    # 14 blocks of 16 for 14 prompts of up to 59 tokens plus 8 outputs: constant eviction and preemption.
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=14, max_num_batched_tokens=32)
    for _ in range(2):
        assert run(llm, PROMPTS, GREEDY) == uncached["greedy"]
        assert run(llm, PROMPTS, SEEDED) == uncached["seeded"]
    metrics = metric_values(llm)
    assert llm.llm_engine.kv_cache_manager.pool.num_evictions > 0
    assert metrics["pagedllm:num_preemptions"] > 0
    assert metrics["pagedllm:prefix_cache_hits"] > 0
    assert_idle(llm)


# ---- parallel sampling shares the prompt's blocks ----

@pytest.mark.parametrize("prompt_len", [20 * BLOCK + 7, 20 * BLOCK + 1], ids=["partial-block", "aligned"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_parallel_sampling_shares_prompt_blocks(tiny_llama_dir: str, prompt_len: int, caching: bool) -> None:
    """n > 1 is n requests, one per sample: with prefix caching the first admitted computes the prompt and
    the others hit its full blocks (in the same step), each computing only its partial tail; without it
    each sample computes the whole prompt. Either way sample i equals a separate request seeded seed + i."""
    n, seed, max_tokens = 4, 7, 6
    prompt = random_prompts(1, VOCAB, [prompt_len], seed=51)[0]
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=caching)
    engine = llm.llm_engine
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("p", {"prompt_token_ids": prompt}, params)
    final = None
    max_held = 0
    with recording(engine) as scheduled:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
            max_held = max(max_held, len(held_blocks(engine)))
    # (the last prompt token is always computed: a hit stops at the last full block before it)
    hit = (prompt_len - 1) // BLOCK * BLOCK if caching else 0
    assert num_computed(scheduled) == prompt_len + (n - 1) * (prompt_len - hit) + n * (max_tokens - 1)
    own_blocks = cdiv(prompt_len + max_tokens - 1, BLOCK) - hit // BLOCK  # blocks each sample holds alone
    assert max_held == hit // BLOCK + n * own_blocks
    if caching:
        assert max_held < n * cdiv(prompt_len + max_tokens, BLOCK) / 3
    assert final is not None and len(final.outputs) == n
    samples = [list(c.token_ids) for c in final.outputs]

    # Sample i is seeded with seed + i: the same as n separate requests.
    singles = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens, ignore_eos=True)
               for i in range(n)]
    assert run(llm, [prompt] * n, singles) == samples
    assert len({tuple(s) for s in samples}) > 1, "samples with different seeds should differ"
    assert_idle(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_parallel_sampling_with_low_precision_kv_cache(tiny_llama_dir: str, kv_cache_dtype: str) -> None:
    """On 2- and 1-byte caches too, the seeded samples of a request with n > 1 (sharing the prompt's
    blocks through the prefix cache) equal separate requests."""
    n, seed = 3, 11
    prompt = random_prompts(1, VOCAB, [4 * BLOCK + 9], seed=52)[0]
    llm = make_llm(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=5, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    singles = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=5, ignore_eos=True) for i in range(n)]
    assert [list(c.token_ids) for c in out.outputs] == run(llm, [prompt] * n, singles)
    assert_idle(llm)


# ---- longest-prefix-match scheduling ----

@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_lpm_gives_the_same_outputs_as_fcfs(tiny_llama_dir: str, uncached: dict, sampling: str) -> None:
    params = GREEDY if sampling == "greedy" else SEEDED
    # Two at a time, so the admission order differs between the policies.
    llm = make_llm(tiny_llama_dir, scheduling_policy="lpm", max_num_seqs=2)
    assert run(llm, PROMPTS, params) == uncached[sampling]
    assert run(llm, PROMPTS, params) == uncached[sampling]
    assert_idle(llm)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(tiny_llama_dir: str, policy: str) -> None:
    llm = make_llm(tiny_llama_dir, scheduling_policy=policy, max_num_seqs=1)
    engine = llm.llm_engine
    cached, unrelated, short = random_prompts(3, VOCAB, [64, 64, 64], seed=61)
    run(llm, [cached + [5]], GREEDY)
    run(llm, [short[:20] + [5]], GREEDY)
    engine.add_request("unrelated", {"prompt_token_ids": unrelated}, GREEDY)
    engine.add_request("short", {"prompt_token_ids": short[:20] + [7] * 30}, GREEDY)  # 16 tokens cached
    engine.add_request("long", {"prompt_token_ids": cached + [9] * 10}, GREEDY)  # 64 tokens cached
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        running = [r.request_id for r in engine.scheduler.running]
        if running and running[0] not in order:
            order.append(running[0])
    assert order == (["long", "short", "unrelated"] if policy == "lpm" else ["unrelated", "short", "long"])
    assert_idle(llm)


# ---- reset ----

def test_reset_prefix_cache_empties_the_cache_when_idle(tiny_llama_dir: str) -> None:
    llm = make_llm(tiny_llama_dir)
    engine = llm.llm_engine
    prompt = random_prompts(1, VOCAB, [50], seed=71)[0]
    first = run(llm, [prompt], GREEDY)
    assert metric_values(llm)["pagedllm:num_cached_blocks"] > 0
    assert cached_tokens(llm, prompt) == 48

    # Refused while a request holds blocks; nothing changes.
    engine.add_request("busy", {"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    num_cached = engine.kv_cache_manager.pool.num_cached_blocks
    assert llm.reset_prefix_cache() is False
    assert engine.kv_cache_manager.pool.num_cached_blocks == num_cached
    while engine.has_unfinished_requests():
        engine.step()

    assert llm.reset_prefix_cache() is True
    assert metric_values(llm)["pagedllm:num_cached_blocks"] == 0
    assert cached_tokens(llm, prompt) == 0
    assert run(llm, [prompt], GREEDY) == first
    assert_idle(llm)


# ---- the benchmark runs (its numbers are not asserted: speed lives in benchmarks) ----

def test_prefix_caching_benchmark_runs(tiny_llama_dir: str, tmp_path) -> None:
    import json

    from pagedllm.benchmarks.prefix_caching import main

    out = tmp_path / "bench.json"
    assert main(["--model", tiny_llama_dir, "--prefix-len", "70", "--question-len", "5", "--num-iters", "2",
                 "--num-iters-warmup", "0", "--max-model-len", "128", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_cached_tokens"] == 64  # the prefix's full blocks
    assert report["tokens_computed_cached"] == 75 - 64
    assert len(report["ttft_uncached_all_s"]) == len(report["ttft_cached_all_s"]) == 2
    assert report["speedup"] > 0
    assert main(["--model", tiny_llama_dir, "--prefix-len", "200", "--max-model-len", "128"]) == 2
