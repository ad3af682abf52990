"""Speculative decoding end to end (issue 6): lossless, greedy-exact, leak-free, and configured like vLLM.

- Greedy outputs with speculation are token for token those without, over batches of mixed lengths, for
  the draft-model and the n-gram proposer, also under chunked prefill, prefix caching, preemption,
  penalties, stop tokens/strings and max_tokens (never a token past a stop or the limit).
- Sampling is lossless: on a 12-token vocabulary with a deliberately different draft, the tokens
  generated with speculation follow the same distribution as without (two-sample chi-square over many
  seeded runs), at temperature 1 and with top-p.
- A draft identical to the target accepts every token; the n-gram proposer gets accepted tokens on a
  repetitive prompt; no KV block leaks (target or draft pool) after runs that reject often.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_model, build_tiny_vocab_model, metric_values, perturbed_copy, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kv_cache.manager import cdiv

VOCAB = 512  # tiny_llama_dir's BPE vocabulary
TINY_VOCAB = 12
P_VALUE_FLOOR = 1e-3  # seeds are fixed: a lossless sampler passes deterministically
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# --- model builders ---------------------------------------------------------------------------------------


def build_cycle_model(dir: Path, cycle: list[int]) -> str:
    """A model whose greedy continuation of each token of `cycle` is the cycle's next token: attention and
    MLP outputs are zeroed (every layer is the identity, so logits see only the current token) and the
    LM head is nudged towards the successor. Random models never repeat their prompt; this one does."""
    build_model(dir, "llama", seed=2)
    path = str(Path(dir) / "model.safetensors")
    weights = load_file(path)
    eps = json.loads((Path(dir) / "config.json").read_text())["rms_norm_eps"]
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    emb = weights["model.embed_tokens.weight"]
    hidden = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + eps) * weights["model.norm.weight"]
    for current, successor in zip(cycle, cycle[1:] + cycle[:1]):
        weights["lm_head.weight"][successor] += 4.0 * hidden[current] / hidden[current].norm()
    save_file(weights, path, metadata={"format": "pt"})
    return str(dir)


@pytest.fixture(scope="module")
def close_draft_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return perturbed_copy(tiny_llama_dir, tmp_path_factory.mktemp("close_draft"), noise=0.03)


# A smaller, unrelated random model with the same tokenizer: it is almost always rejected.
FAR_DRAFT = dict(seed=7, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64)


@pytest.fixture(scope="module")
def far_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model(tmp_path_factory.mktemp("far_draft"), "llama", **FAR_DRAFT)


def make_llm(model: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    return LLM(model=model, dtype="float32", seed=0, **kwargs)


@pytest.fixture(scope="module")
def base_llm(tiny_llama_dir: str) -> LLM:
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def draft_llm(tiny_llama_dir: str, close_draft_dir: str) -> LLM:
    return make_llm(tiny_llama_dir, speculative_model=close_draft_dir, num_speculative_tokens=K)


@pytest.fixture(scope="module")
def same_llm(tiny_llama_dir: str) -> LLM:
    return make_llm(tiny_llama_dir, speculative_model=tiny_llama_dir, num_speculative_tokens=K)


@pytest.fixture(scope="module")
def ngram_llm(tiny_llama_dir: str) -> LLM:
    return make_llm(tiny_llama_dir, speculative_config=dict(NGRAM))


def token_ids(llm: LLM, prompts: list, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def mixed_batch(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of very different lengths (some repetitive, so n-gram lookups fire) and output lengths."""
    prompts = random_prompts(7, VOCAB, lengths=[1, 3, 9, 17, 40, 70, 5], seed=seed)
    prompts.append([11, 12, 13, 14] * 6)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 25, 12, 30, 7, 20, 1, 28)]
    return prompts, params


def flat_step_cost(llm: LLM) -> None:
    """Every target pass reports the same time, whatever its size: the model-free adaptive k prices
    proposals from measured step times (spec_decode/adaptive.StepCostModel), and a loaded machine's
    times could price one out; tests of the acceptance side hold the cost still."""
    decoder = llm.llm_engine.spec_decoder
    record_step = decoder.record_step
    decoder.record_step = lambda elapsed_s, output: record_step(0.01, output)


def spec_values(llm: LLM) -> dict[str, float]:
    return {name.removeprefix("pagedllm:spec_decode_"): value
            for name, value in metric_values(llm).items() if name.startswith("pagedllm:spec_decode_")}


def test_draft_runs_in_the_targets_dtype(tiny_llama_dir: str, tmp_path: Path) -> None:
    """As in vLLM, the draft takes the target's dtype: a bf16 draft checkpoint beside a target run in fp32
    (what dtype="auto" picks on a CPU without bf16 matmul units) decodes in fp32, not in slow bf16."""
    draft_dir = build_model(tmp_path / "bf16_draft", "llama", **FAR_DRAFT, dtype=torch.bfloat16)
    assert json.loads((Path(draft_dir) / "config.json").read_text())["dtype"] == "bfloat16"
    llm = LLM(model=tiny_llama_dir, dtype="auto", max_model_len=512, speculative_model=draft_dir,
              num_speculative_tokens=K)  # the target's checkpoint is fp32
    runner = llm.llm_engine.spec_decoder.proposer.runner
    assert runner.model_config.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in runner.model.parameters() if p.is_floating_point())


def test_only_the_draft_trades_batch_invariance_for_faster_small_matmuls(draft_llm: LLM) -> None:
    """With oneDNN's layout, the draft's small fp32 projections stay plain for F.linear (its rounding never
    reaches an output); the target's are packed, which computes a row the same way in any batch. The
    blocked kernel is both fast and batch-invariant, so where it runs both models take it."""
    from pagedllm.layers.linear import BlockedLinear, blocked_layout_available, packed_linear, prepack_enabled

    if not prepack_enabled(torch.device("cpu"), torch.float32):
        pytest.skip("torch built without oneDNN")
    target = draft_llm.llm_engine.model_runner.model
    draft = draft_llm.llm_engine.spec_decoder.proposer.runner.model
    if blocked_layout_available(torch.float32):
        for model in (target, draft):
            assert all(isinstance(layer.mlp.gate_up_proj.matmul, BlockedLinear) for layer in model.layers)
        return
    assert all(layer.mlp.gate_up_proj.matmul is packed_linear for layer in target.layers)
    assert not any(layer.mlp.gate_up_proj.matmul is packed_linear for layer in draft.layers)


def test_draft_uses_the_targets_attention_backend(tiny_llama_dir: str, close_draft_dir: str) -> None:
    llm = make_llm(tiny_llama_dir, speculative_model=close_draft_dir, num_speculative_tokens=K,
                   attention_backend="TORCH_FLASH")
    assert type(llm.llm_engine.spec_decoder.proposer.runner.backend) is type(llm.llm_engine.model_runner.backend)
    assert llm.llm_engine.model_runner.backend.name == "TORCH_FLASH"


# --- greedy: token for token ------------------------------------------------------------------------------


@pytest.mark.parametrize("proposer", ["draft_model", "identical_draft", "ngram"])
def test_greedy_matches_plain_decoding(request: pytest.FixtureRequest, base_llm: LLM, proposer: str) -> None:
    llm = request.getfixturevalue({"draft_model": "draft_llm", "identical_draft": "same_llm",
                                   "ngram": "ngram_llm"}[proposer])
    before = spec_values(llm)
    for seed in (0, 1):
        prompts, params = mixed_batch(seed)
        want = token_ids(base_llm, prompts, params)
        got = token_ids(llm, prompts, params)
        assert got == want
        assert [len(t) for t in got] == [p.max_tokens for p in params]
    after = spec_values(llm)
    assert after["num_draft_tokens"] > before["num_draft_tokens"], "the proposer must have proposed"
    if proposer == "draft_model":  # partial acceptance, so rollback of both KV caches is exercised
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        assert 0 < accepted < after["num_draft_tokens"] - before["num_draft_tokens"]


def test_identical_draft_accepts_every_token(same_llm: LLM) -> None:
    before = spec_values(same_llm)
    prompts = random_prompts(3, VOCAB, lengths=[4, 20, 33], seed=5)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=21, ignore_eos=True, seed=3)
        token_ids(same_llm, prompts, params)
    after = spec_values(same_llm)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    assert drafted > 0
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] == drafted
    # 20 tokens after the first: 4 passes of k+1 = 5 tokens each per request.
    assert after["num_drafts"] - before["num_drafts"] == 2 * 3 * 4


def test_ngram_accepts_tokens_on_a_repetitive_prompt(tmp_path: Path) -> None:
    cycle = [10, 20, 30, 40, 50, 60, 70, 80]
    model = build_cycle_model(tmp_path / "cycle", cycle)
    prompt = cycle * 4 + cycle[:2]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = token_ids(make_llm(model), [prompt], params)
    llm = make_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    flat_step_cost(llm)
    assert token_ids(llm, [prompt], params) == want
    values = spec_values(llm)
    assert values["num_accepted_tokens"] >= 0.9 * values["num_draft_tokens"] > 0
    assert values["mean_tokens_per_pass"] > 4.0
    assert metric_values(llm)["pagedllm:generation_tokens"] >= 40


def test_ngram_lookup_rules() -> None:
    from pagedllm.spec_decode.ngram import NgramProposer

    lookup = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    assert lookup.propose_tokens([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # longest suffix [1, 2, 3]
    assert lookup.propose_tokens([8, 1, 2, 5, 6, 7, 1, 2, 9, 9, 1, 2], 2) == [9, 9]  # latest full occurrence
    assert lookup.propose_tokens([5] * 8, 3) == [5, 5, 5]  # a short loop still proposes k tokens
    assert lookup.propose_tokens([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]  # only what exists
    assert lookup.propose_tokens([1, 2, 3, 1], 3) == []  # a 1-gram match is below prompt_lookup_min
    assert NgramProposer(1, 1).propose_tokens([1, 2, 3, 1], 3) == [2, 3, 1]


# --- sampling: the same distribution as without speculation ---------------------------------------------


def two_sample_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors come from one distribution (cells with small expected
    counts pooled)."""
    a, b = a.double(), b.double()
    n_a, n_b = a.sum(), b.sum()
    total = a + b
    keep = total > 0
    a, b, total = a[keep], b[keep], total[keep]
    exp_a, exp_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    small = (exp_a < 5) | (exp_b < 5)
    if small.any():
        a = torch.cat([a[~small], a[small].sum().unsqueeze(0)])
        b = torch.cat([b[~small], b[small].sum().unsqueeze(0)])
        total = a + b
        exp_a, exp_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    stat = (((a - exp_a) ** 2 / exp_a) + ((b - exp_b) ** 2 / exp_b)).sum()
    df = len(a) - 1
    if df <= 0:
        return 1.0
    return 1.0 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(stat.float()).item()


@pytest.fixture(scope="module")
def tiny_far_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vocab_model(tmp_path_factory.mktemp("tiny_draft"), vocab_size=TINY_VOCAB, seed=5,
                                  hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=32)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.8)], ids=["t1", "top_p"])
def test_sampling_is_lossless(tiny_vocab_dir: str, tiny_far_draft_dir: str, sampling: dict) -> None:
    num_runs, num_tokens = 2000, 4
    prompt = [3, 4, 5, 6]
    plain = make_llm(tiny_vocab_dir, max_model_len=64)
    spec = make_llm(tiny_vocab_dir, max_model_len=64, speculative_model=tiny_far_draft_dir,
                    num_speculative_tokens=3)
    results = []
    # Unseeded with speculation: seeded requests are verified against their own plain sample (identical
    # output, see test_seeded_output_independent_of_speculation_budget_and_batch); these go through the
    # rejection sampler.
    for llm, seeds in ((plain, range(num_runs)), (spec, [None] * num_runs)):
        params = [SamplingParams(max_tokens=num_tokens, ignore_eos=True, seed=seed, **sampling) for seed in seeds]
        results.append(torch.tensor(token_ids(llm, [prompt] * num_runs, params)))
    plain_ids, spec_ids = results
    values = spec_values(spec)
    rate = values["draft_acceptance_rate"]
    assert 0.1 < rate < 0.9, f"acceptance {rate}: both accepting and rejecting must be exercised"
    for pos in range(num_tokens):
        a = torch.bincount(spec_ids[:, pos], minlength=TINY_VOCAB)
        b = torch.bincount(plain_ids[:, pos], minlength=TINY_VOCAB)
        assert two_sample_p_value(a, b) > P_VALUE_FLOOR, f"position {pos}: spec {a.tolist()} vs plain {b.tolist()}"
    pair = lambda ids: torch.bincount(ids[:, 0] * TINY_VOCAB + ids[:, 1], minlength=TINY_VOCAB ** 2)
    assert two_sample_p_value(pair(spec_ids), pair(plain_ids)) > P_VALUE_FLOOR


def test_seeded_request_is_reproducible(draft_llm: LLM) -> None:
    prompts = random_prompts(4, VOCAB, lengths=[6, 12, 3, 25], seed=8)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=20, ignore_eos=True)
    alone = token_ids(draft_llm, [prompts[2]], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=10 + i, ignore_eos=True) for i in range(4)]
    others[2] = seeded
    assert token_ids(draft_llm, prompts, others)[2] == alone
    assert token_ids(draft_llm, [prompts[2]], seeded)[0] == alone
    reseeded = SamplingParams(temperature=0.9, top_p=0.95, seed=78, max_tokens=20, ignore_eos=True)
    assert token_ids(draft_llm, [prompts[2]], reseeded)[0] != alone


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_seeded_output_independent_of_speculation_budget_and_batch(
        tiny_llama_dir: str, close_draft_dir: str, base_llm: LLM, proposer: str) -> None:
    """A seeded request's tokens are a function of (seed, position): the same without speculation, and with
    it alone, first or last in a batch, under a 16-token budget that cuts proposals and chunks prefills."""
    prompts = random_prompts(4, VOCAB, lengths=[6, 12, 3, 25], seed=8)
    prompts.append(([11, 12, 13, 14] * 5)[:-1])  # repetitive: n-gram proposals fire
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.3, top_k=20, seed=5, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.05)]
    others = [SamplingParams(temperature=1.0, max_tokens=10 + i, ignore_eos=True) for i in range(4)]
    spec = (dict(speculative_model=close_draft_dir, num_speculative_tokens=K) if proposer == "draft_model"
            else dict(speculative_config=dict(NGRAM)))
    want = [token_ids(base_llm, [prompts[4]], params)[0] for params in seeded]
    for budget in (16, 2048):
        llm = make_llm(tiny_llama_dir, max_num_batched_tokens=budget, **spec)
        for params, reference in zip(seeded, want):
            assert token_ids(llm, [prompts[4]], params)[0] == reference
            assert token_ids(llm, prompts, others + [params])[4] == reference, f"last in a batch, budget {budget}"
            assert token_ids(llm, prompts[::-1], [params] + others)[0] == reference
        values = spec_values(llm)
        assert values["num_accepted_tokens"] > 0, "proposals must have been verified and accepted"


def test_draft_catch_up_after_unverified_proposals(same_llm: LLM) -> None:
    """Proposals dropped unverified (a budget cut), then the target samples the draft's first proposal
    itself: the draft already has KV for that token but must still feed it for its logits. This crashed
    the catch-up (`assert num_new >= 1`) when an LLM with a draft model was reused."""
    from pagedllm.layers.sampler import SamplingRow
    from pagedllm.spec_decode.proposer import DraftRequest, ProposeInput

    engine = same_llm.llm_engine
    proposer = engine.spec_decoder.proposer
    prompt = random_prompts(1, VOCAB, lengths=[10], seed=21)[0]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", prompt, params)
    engine.step()  # the prompt, its first token, and K proposals past it
    request = engine.scheduler.requests["a"]
    output, first = list(request.output_token_ids), list(request.spec_token_ids)
    assert len(output) == 1 and len(first) == K

    def propose(num_computed_tokens: int) -> list[int]:
        # as if the next step computed the first token and sampled the first proposal without verifying it
        tokens = prompt + output + first[:1]
        inputs = ProposeInput([DraftRequest("a", tokens, params, num_computed_tokens=num_computed_tokens)], [K],
                              [SamplingRow(params, prompt, output + first[:1], [])])
        return proposer.propose(inputs)["a"][0]

    again = propose(len(prompt))
    proposer.free({"a"})
    assert again == propose(0) == first[1:] + again[K - 1:]  # a draft starting afresh agrees
    engine.abort_request("a")
    engine.step()
    assert not proposer.seqs
    # and the LLM stays usable for more generate calls
    prompts, params_list = mixed_batch(4)
    assert [len(t) for t in token_ids(same_llm, prompts, params_list)] == [p.max_tokens for p in params_list]


def test_shared_prefix_workload_keeps_proposing(tiny_llama_dir: str, base_llm: LLM) -> None:
    """Ten requests share a 48-token prefix: with prefix caching they fit the target's 64 blocks, and the
    draft's KV lives in the same blocks, so the prefix hit spares the draft its prefix too and every
    request keeps getting proposals."""
    shared = random_prompts(1, VOCAB, lengths=[48], seed=23)[0]
    prompts = [shared + tail for tail in random_prompts(10, VOCAB, lengths=[3] * 10, seed=24)]
    params = SamplingParams(temperature=0.0, max_tokens=1 + 2 * (K + 1), ignore_eos=True)
    llm = make_llm(tiny_llama_dir, speculative_model=tiny_llama_dir, num_speculative_tokens=K, block_size=4,
                   num_gpu_blocks_override=64)
    kv = llm.llm_engine.kv_cache_manager
    assert kv.pool.num_blocks < len(prompts) * cdiv(len(prompts[0]) + params.max_tokens, 4)  # unshared
    proposer = llm.llm_engine.spec_decoder.proposer
    pass_sizes: list[int] = []
    forward = proposer.runner.forward
    proposer.runner.forward = lambda batch: (pass_sizes.append(batch.input_ids.numel()), forward(batch))[1]
    assert token_ids(llm, prompts, params) == token_ids(base_llm, prompts, params)
    values = spec_values(llm)
    # the identical draft is always accepted: each request verifies exactly twice (k+1 tokens a pass)
    assert values["num_drafts"] == 2 * len(prompts)
    assert values["num_accepted_tokens"] == values["num_draft_tokens"] == 2 * K * len(prompts)
    assert kv.prefix_cache_hits >= 9 * 48
    # the draft computed the shared prefix once, not once per request
    assert sum(pass_sizes) < 2 * 48 + len(prompts) * (3 + params.max_tokens + K * 2)
    assert kv.num_free_blocks == kv.pool.num_blocks and not proposer.seqs


def test_draft_catch_up_stays_within_the_token_budget(tiny_llama_dir: str, base_llm: LLM) -> None:
    """The draft computes each prompt chunk in the step the target does: no draft pass is larger than
    the step's token budget, and a long prompt is spread over steps as the target's is."""
    budget = 16
    llm = make_llm(tiny_llama_dir, speculative_model=tiny_llama_dir, num_speculative_tokens=K,
                   max_num_batched_tokens=budget)
    proposer = llm.llm_engine.spec_decoder.proposer
    pass_sizes: list[int] = []
    forward = proposer.runner.forward
    proposer.runner.forward = lambda batch: (pass_sizes.append(batch.input_ids.numel()), forward(batch))[1]
    prompt = random_prompts(1, VOCAB, lengths=[70], seed=25)[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = token_ids(base_llm, [prompt], params)
    assert token_ids(llm, [prompt], params) == want
    assert max(pass_sizes) <= budget and sum(pass_sizes) >= 70
    assert spec_values(llm)["num_draft_tokens"] > 0


# --- memory: no leaks, rollback frees ---------------------------------------------------------------------


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_no_block_leaks_when_drafts_are_rejected(tiny_llama_dir: str, far_draft_dir: str, proposer: str) -> None:
    spec = (dict(speculative_model=far_draft_dir, num_speculative_tokens=K) if proposer == "draft_model"
            else dict(speculative_config=dict(NGRAM)))
    llm = make_llm(tiny_llama_dir, block_size=4, **spec)
    engine = llm.llm_engine
    target_kv = engine.kv_cache_manager
    # a draft model's KV lives in the target's blocks, with K slots past a request's scheduled tokens
    lookahead = K if proposer == "draft_model" else 0
    prompts, _ = mixed_batch(3)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=10 + 3 * i, ignore_eos=True, seed=i)
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            # Rejected tokens are rolled back: a request holds the blocks of its computed tokens (and, with
            # a draft model, of the lookahead slots its last step took).
            blocks = target_kv.get_block_ids(request.request_id)
            assert cdiv(request.num_computed_tokens, 4) <= len(blocks)
            assert len(blocks) <= cdiv(request.num_computed_tokens + lookahead, 4)
    values = spec_values(llm)
    assert values["num_accepted_tokens"] < 0.5 * values["num_draft_tokens"], "the drafts should be rejected often"
    assert target_kv.num_free_blocks == target_kv.pool.num_blocks and not target_kv.req_to_blocks
    assert not getattr(engine.spec_decoder.proposer, "seqs", None)


# --- together with the rest of the engine -----------------------------------------------------------------


def test_chunked_prefill_prefix_caching_and_preemption(tiny_llama_dir: str, close_draft_dir: str,
                                                       base_llm: LLM) -> None:
    shared = random_prompts(1, VOCAB, lengths=[16], seed=11)[0]
    tails = random_prompts(6, VOCAB, lengths=[3, 20, 9, 30, 1, 14], seed=12)
    prompts = [shared + tail for tail in tails]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 2 * i, ignore_eos=True) for i in range(6)]
    want = token_ids(base_llm, prompts, params)
    for spec in (dict(speculative_model=close_draft_dir, num_speculative_tokens=K),
                 dict(speculative_config=dict(NGRAM))):
        llm = make_llm(tiny_llama_dir, block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=24,
                       **spec)
        assert token_ids(llm, prompts, params) == want
        metrics = metric_values(llm)
        assert metrics["pagedllm:num_preemptions"] > 0
        assert metrics["pagedllm:prefix_cache_hits"] > 0
        assert metrics["pagedllm:spec_decode_num_draft_tokens"] > 0
        kv = llm.llm_engine.kv_cache_manager
        assert kv.num_free_blocks == kv.pool.num_blocks


def test_aborted_request_frees_its_draft_blocks(tiny_llama_dir: str, close_draft_dir: str) -> None:
    """The draft's KV is in the request's blocks: an abort gives them back with the target's, and the
    proposer forgets the request."""
    llm = make_llm(tiny_llama_dir, speculative_model=close_draft_dir, num_speculative_tokens=K)
    engine = llm.llm_engine
    kv, proposer = engine.kv_cache_manager, engine.spec_decoder.proposer
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", random_prompts(1, VOCAB, lengths=[20], seed=17)[0], params)
    engine.add_request("b", random_prompts(1, VOCAB, lengths=[9], seed=18)[0], params)
    for _ in range(3):
        engine.step()
    assert kv.get_block_ids("a") and kv.get_block_ids("b") and set(proposer.seqs) == {"a", "b"}
    engine.abort_request("a")
    engine.step()
    assert not kv.get_block_ids("a") and kv.get_block_ids("b") and set(proposer.seqs) == {"b"}
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_free_blocks == kv.pool.num_blocks and not proposer.seqs


def test_stops_and_limits_are_never_overrun(same_llm: LLM, base_llm: LLM) -> None:
    """With a draft that is always accepted, a stop falls inside an accepted run: nothing after it leaks."""
    prompts = random_prompts(3, VOCAB, lengths=[5, 18, 31], seed=13)
    free = token_ids(base_llm, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        stop_token = free[i][7 + i]
        cases = [
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token]),
            SamplingParams(temperature=0.0, max_tokens=13 + i, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=30, min_tokens=9, stop_token_ids=[stop_token]),
        ]
        for params in cases:
            want = base_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            got = same_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.finish_reason, got.stop_reason) == \
                (want.token_ids, want.finish_reason, want.stop_reason)
        text = base_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        if stop.strip():
            # the tokens, logprobs and cumulative logprob end with the token that completed the stop string
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=0)
            want = base_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            got = same_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert (got.text, got.finish_reason, got.token_ids) == (want.text, want.finish_reason, want.token_ids)
            assert len(got.logprobs) == len(want.logprobs)
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


def test_penalties_and_logprobs_match_plain_decoding(same_llm: LLM, draft_llm: LLM, base_llm: LLM) -> None:
    prompts = random_prompts(3, VOCAB, lengths=[7, 2, 26], seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True, repetition_penalty=1.4,
                            presence_penalty=0.5, frequency_penalty=0.3, logprobs=3)
    want = base_llm.generate(prompts, params, use_tqdm=False)
    for llm in (same_llm, draft_llm):
        got = llm.generate(prompts, params, use_tqdm=False)
        for g, w in zip(got, want):
            g0, w0 = g.outputs[0], w.outputs[0]
            assert g0.token_ids == w0.token_ids
            assert len(g0.logprobs) == len(w0.logprobs) == 18
            for gl, wl in zip(g0.logprobs, w0.logprobs):
                assert set(gl) == set(wl)
                for token in wl:
                    assert gl[token].rank == wl[token].rank
                    assert gl[token].logprob == pytest.approx(wl[token].logprob, abs=1e-4)
            assert g0.cumulative_logprob == pytest.approx(w0.cumulative_logprob, abs=1e-3)


def test_bad_words_match_plain_decoding(same_llm: LLM, draft_llm: LLM, base_llm: LLM) -> None:
    """A draft that proposes a bad word has it rejected where plain decoding masks it."""
    prompts = random_prompts(3, VOCAB, lengths=[7, 12, 20], seed=16)
    plain = base_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)
    words = [base_llm.get_tokenizer().decode(o.outputs[0].token_ids[3:5]) for o in plain]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=words)
    want = token_ids(base_llm, prompts, params)
    assert want != [o.outputs[0].token_ids for o in plain]
    for llm in (same_llm, draft_llm):
        assert token_ids(llm, prompts, params) == want


def test_context_limit_is_never_overrun(tiny_llama_dir: str) -> None:
    """Near max_model_len, k shrinks so that verified tokens never pass the context length."""
    prompts = random_prompts(3, VOCAB, lengths=[50, 55, 60], seed=15)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    want = token_ids(make_llm(tiny_llama_dir, max_model_len=64), prompts, params)
    assert [len(t) for t in want] == [14, 9, 4]
    for spec in (dict(speculative_model=tiny_llama_dir, num_speculative_tokens=5),
                 dict(speculative_config=dict(NGRAM))):
        assert token_ids(make_llm(tiny_llama_dir, max_model_len=64, **spec), prompts, params) == want


def test_adaptive_k_shrinks_for_a_poor_draft(tiny_llama_dir: str, far_draft_dir: str, base_llm: LLM) -> None:
    prompts, params = mixed_batch(4)
    llm = make_llm(tiny_llama_dir, speculative_config={"model": far_draft_dir, "num_speculative_tokens": K,
                                                       "adaptive_num_speculative_tokens": True})
    assert token_ids(llm, prompts, params) == token_ids(base_llm, prompts, params)
    values = spec_values(llm)
    assert values["num_draft_tokens"] < 1.5 * values["num_drafts"], "a rejected draft should get k near 1"


def test_adaptive_k_keeps_k_while_proposals_are_accepted(tmp_path: Path) -> None:
    cycle = [10, 20, 30, 40, 50, 60, 70, 80]
    model = build_cycle_model(tmp_path / "cycle", cycle)
    llm = make_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                              "prompt_lookup_min": 2, "adaptive_num_speculative_tokens": True})
    flat_step_cost(llm)
    token_ids(llm, [cycle * 3], SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True))
    values = spec_values(llm)
    assert values["num_accepted_tokens"] == values["num_draft_tokens"]
    assert values["mean_tokens_per_pass"] == K + 1


def test_best_k_follows_acceptance_and_draft_cost() -> None:
    from pagedllm.spec_decode.spec_decoder import best_num_speculative_tokens, expected_tokens_per_pass

    assert expected_tokens_per_pass(0.8, 5) == pytest.approx(3.6893, abs=1e-4)  # the seed's worked number
    assert expected_tokens_per_pass(1.0, 5) == 6
    assert best_num_speculative_tokens(0.95, 5, 0.05) == 5
    assert best_num_speculative_tokens(0.1, 5, 0.05) == 1
    ks = [best_num_speculative_tokens(alpha, 8, 0.2) for alpha in (0.2, 0.5, 0.7, 0.9, 0.97)]
    assert ks == sorted(ks) and ks[0] < ks[-1]


def test_parallel_sampling_with_speculation(draft_llm: LLM) -> None:
    out = draft_llm.generate([[5, 6, 7, 8]], SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True,
                                                            seed=2), use_tqdm=False)[0]
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)


def test_metrics_are_reported(draft_llm: LLM) -> None:
    token_ids(draft_llm, [[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    names = {m.name for m in draft_llm.get_metrics()}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                 "mean_tokens_per_pass", "draft_acceptance_rate"):
        assert f"pagedllm:spec_decode_{name}" in names
    positions = {m.labels["position"] for m in draft_llm.get_metrics()
                 if m.name == "pagedllm:spec_decode_num_accepted_tokens_per_pos"}
    assert positions == {str(i) for i in range(K)}
    values = spec_values(draft_llm)
    assert values["mean_tokens_per_pass"] == pytest.approx(
        (values["num_accepted_tokens"] + values["num_drafts"]) / values["num_drafts"])


# --- configuration ------------------------------------------------------------------------------------------


def test_both_spellings_and_cli_flags(tiny_llama_dir: str, close_draft_dir: str) -> None:
    by_config = make_llm(tiny_llama_dir, speculative_config=json.dumps(
        {"method": "draft_model", "model": close_draft_dir, "num_speculative_tokens": 3}))
    decoder = by_config.llm_engine.spec_decoder
    assert decoder.config.method == "draft_model" and decoder.num_speculative_tokens == 3
    ngram = make_llm(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                         "prompt_lookup_max": 4})
    config = ngram.llm_engine.spec_decoder.config
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-model", close_draft_dir, "--num-speculative-tokens", "3"]))
    assert (args.speculative_model, args.num_speculative_tokens) == (close_draft_dir, 3)
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", json.dumps(NGRAM)]))
    assert args.speculative_config == NGRAM


@pytest.mark.parametrize("kwargs, field", [
    (dict(speculative_model="DRAFT", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_model="DRAFT"), "num_speculative_tokens"),
    (dict(num_speculative_tokens=3), "num_speculative_tokens"),
    (dict(speculative_model="/nonexistent/draft", num_speculative_tokens=3), "speculative_model"),
    (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 3}), "method"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
                              "prompt_lookup_max": 2}), "prompt_lookup_min"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}),
     "prompt_lookup_min"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}), "unknown keys"),
    (dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 3}), "model"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                              "adaptive_num_speculative_tokens": "yes"}), "adaptive_num_speculative_tokens"),
    (dict(speculative_model="DRAFT", num_speculative_tokens=3,
          speculative_config={"method": "ngram", "num_speculative_tokens": 3}), "not both"),
    (dict(speculative_model="OTHER_VOCAB", num_speculative_tokens=3), "vocab_size"),
], ids=["k0", "k_missing", "k_without_model", "missing_dir", "bad_method", "min_gt_max", "min0", "unknown_key",
        "no_draft_model", "adaptive_not_bool", "both_spellings", "vocab_mismatch"])
def test_bad_configs_are_refused(tiny_llama_dir: str, close_draft_dir: str, tiny_vocab_dir: str,
                                 kwargs: dict, field: str) -> None:
    if kwargs.get("speculative_model") == "DRAFT":
        kwargs["speculative_model"] = close_draft_dir
    elif kwargs.get("speculative_model") == "OTHER_VOCAB":
        kwargs["speculative_model"] = tiny_vocab_dir
    with pytest.raises(ValueError, match=field):
        make_llm(tiny_llama_dir, **kwargs)


# --- the benchmark runs (its numbers are not asserted: speed lives in benchmarks) ------------------------


def test_benchmark_runs_and_writes_json(tiny_llama_dir: str, close_draft_dir: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.benchmarks import spec_decode

    out = tmp_path / "spec.json"
    # (the tiny model's 512-token vocabulary spells a function in many tokens: a longer context)
    assert spec_decode.main(["--model", tiny_llama_dir, "--num-prompts", "2", "--output-len", "8", "-k", "3",
                             "--batch-size", "2", "--num-threads", "1", "--max-model-len", "4096",
                             "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tok/pass" in printed and "must-show:" in printed
    report = json.loads(out.read_text())
    results = report["results"]
    workloads = ("proofread", "code-edit", "extract", "chat")
    assert {(r["workload"], r["mode"], r["batch_size"], r["method"]) for r in results} == {
        (w, mode, 1, m) for w in workloads for mode in ("greedy", "seeded") for m in ("plain", "ngram", "suffix")
    } | {("mixed", mode, 2, m) for mode in ("greedy", "seeded") for m in ("plain", "ngram", "suffix")}
    for r in results:
        assert r["num_identical"] == r["num_requests"] == 2  # outputs equal plain decoding's, token for token
        assert 1.0 <= r["tokens_per_pass"] <= 4.0
    assert any("identical to plain" in c["check"] for c in report["must_show"])
    # the demo pair's raw-text workloads with a draft model
    assert spec_decode.main(["--model", tiny_llama_dir, "--draft-model", close_draft_dir, "--methods", "draft_model",
                             "ngram", "--workloads", "code", "edit", "--modes", "greedy", "--batch-size", "0",
                             "--num-prompts", "2", "--input-len", "24", "--output-len", "8", "-k", "3",
                             "--ignore-eos", "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {(r["workload"], r["method"]) for r in results} == {
        (w, m) for w in ("code", "edit") for m in ("plain", "draft_model", "ngram")}
    assert all(r["num_output_tokens"] == 2 * 8 for r in results)


def test_ngram_spelled_as_a_model_in_speculative_config(tiny_llama_dir: str) -> None:
    """vLLM's older spelling, {"model": "[ngram]"}, is the n-gram proposer."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.spec_decode import SpeculativeConfig

    args = EngineArgs(model=tiny_llama_dir, speculative_config={"model": "[ngram]", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_max": 4})
    config = SpeculativeConfig.from_engine_args(args, None)
    assert config.method == "ngram" and config.num_speculative_tokens == 3
