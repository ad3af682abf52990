"""Gemma 2, Gemma 3, Phi-3 and sliding-window Mistral / Qwen2 against transformers on the same random weights.

Windows (20 tokens) are shorter than most prompts and not a multiple of the block size (16), so they
cut through blocks; a 24-token budget splits prefills into chunks that cross the window's edge; prompts
sharing a 40-token prefix hit the prefix cache (and a second pass hits it for every prompt); a tiny KV
pool forces preemption. In fp32 every path gives transformers' greedy tokens, and first-token logprobs
within 1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_parity import assert_greedy_matches
from tiny_models import build_model, hf_greedy, hf_logits, load_hf, metric_values, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.config import sliding_window_layers

WINDOW = 20
MAX_NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4

# Two full blocks of shared prefix: prompts 4 and 5 reuse prompt 3's cached blocks.
PROMPT_LENGTHS = [1, 9, 21, 64, 90]


def _longrope(n: int) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(n)],
            "long_factor": [2.0 + 0.5 * i for i in range(n)]}


CASES: dict[str, dict[str, Any]] = {
    # 3 layers: local, global, local (pattern 2); separate RoPE bases; q/k norm; GQA.
    "gemma3": dict(arch="gemma3", num_hidden_layers=3, head_dim=16, rope_theta=100000.0, seed=40,
                   extra_config=dict(sliding_window=WINDOW, sliding_window_pattern=2,
                                     query_pre_attn_scalar=24)),
    "gemma3_tied": dict(arch="gemma3", head_dim=16, tie_word_embeddings=True, seed=41,
                        extra_config=dict(sliding_window=WINDOW, layer_types=["full_attention",
                                                                              "sliding_attention"])),
    # Attention and final logit soft-capping small enough to bite on random weights.
    "gemma2": dict(arch="gemma2", head_dim=16, seed=42,
                   extra_config=dict(sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                     final_logit_softcapping=3.0)),
    "phi3": dict(arch="phi3", seed=43, extra_config=dict(sliding_window=WINDOW)),
    "mistral_window": dict(arch="mistral", seed=44, extra_config=dict(sliding_window=WINDOW)),
    # Qwen2: layers from max_window_layers on slide.
    "qwen2_window": dict(arch="qwen2", num_hidden_layers=3, seed=45,
                         extra_config=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}


UNIFORM_WINDOW = ("phi3", "mistral_window")


def _engine_outputs(model_dir: str, prompts: list[list[int]], **engine_args: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(model=model_dir, dtype="float32", seed=0, block_size=16, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    prompts = random_prompts(len(PROMPT_LENGTHS), vocab_size, PROMPT_LENGTHS, seed=seed)
    shared = prompts[3][:32]
    return prompts + [shared + prompts[1], shared + prompts[2]]


def _check(model_dir: str, prompts: list[list[int]], outputs: list[Any], want: list[tuple[list[int], Any]]) -> None:
    for prompt, out, (want_ids, want_logits) in zip(prompts, outputs, want):
        completion = out.outputs[0]
        assert_greedy_matches(model_dir, prompt, list(completion.token_ids), want_ids)
        token = completion.token_ids[0]
        want_lp = torch.log_softmax(want_logits, dim=-1)[token].item()
        assert completion.logprobs[0][token].logprob == pytest.approx(want_lp, abs=LOGPROB_ATOL), len(prompt)


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_windows_chunks_prefix_hits_and_preemption(case: str,
                                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = build_model(tmp_path_factory.mktemp(case), **CASES[case])
    vocab_size = hf_logits(model_dir, [3]).shape[-1]
    prompts = _prompts(vocab_size, CASES[case]["seed"])
    want = [hf_greedy(model_dir, p, MAX_NEW_TOKENS) for p in prompts]

    # Chunked prefill across the window's edge, shared-prefix hits, then every prompt again from cache.
    llm, outputs = _engine_outputs(model_dir, prompts, max_num_batched_tokens=24)
    _check(model_dir, prompts, outputs, want)
    again = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                                                 logprobs=1), use_tqdm=False)
    _check(model_dir, prompts, again, want)
    metrics = metric_values(llm)
    assert metrics["pagedllm:prefix_cache_hits"] > 0
    # Every layer sliding: blocks behind the window went back to the pool as requests moved on (a model
    # with full layers keeps them all); at the end every block is free again.
    assert (metrics["pagedllm:kv_blocks_freed_by_window"] > 0) == (case in UNIFORM_WINDOW)
    assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]

    # A pool too small for all requests at once: preempted requests recompute to the same tokens.
    tight, outputs = _engine_outputs(model_dir, prompts, num_gpu_blocks_override=8, max_num_batched_tokens=128)
    _check(model_dir, prompts, outputs, want)
    assert metric_values(tight)["pagedllm:num_preemptions"] > 0


def test_async_scheduling_frees_behind_the_window_safely(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With async scheduling the next plan (and the blocks it gives back) is made while a step runs: the
    step in flight reads only blocks its own queries see, so the outputs stay transformers'."""
    model_dir = build_model(tmp_path_factory.mktemp("mistral_async"), **CASES["mistral_window"])
    prompts = _prompts(512, CASES["mistral_window"]["seed"])
    want = [hf_greedy(model_dir, p, MAX_NEW_TOKENS) for p in prompts]
    llm, outputs = _engine_outputs(model_dir, prompts, async_scheduling=True, num_gpu_blocks_override=12,
                                   max_num_batched_tokens=32)
    _check(model_dir, prompts, outputs, want)
    assert metric_values(llm)["pagedllm:kv_blocks_freed_by_window"] > 0


@pytest.mark.parametrize("case", ["gemma3", "mistral_window"])
def test_the_window_changes_the_reference(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The parity above is not vacuous: on these prompts transformers' own logits differ with the window
    widened past the context, so an engine that ignored it would fail."""
    model_dir = build_model(tmp_path_factory.mktemp(case), **CASES[case])
    prompt = _prompts(512, CASES[case]["seed"])[4]
    model = load_hf(model_dir)
    with torch.no_grad():
        windowed = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        model.config.sliding_window = 4096
        try:
            full = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        finally:
            model.config.sliding_window = WINDOW
    assert (windowed - full).abs().max().item() > 1e-2


def test_phi3_longrope_and_partial_rotary(tmp_path_factory: pytest.TempPathFactory) -> None:
    """LongRoPE with partial rotary (0.75 of a 16-wide head: 6 factors). The factor set is fixed per engine:
    short when max_model_len fits in original_max_position_embeddings (what transformers computes for such
    sequences), long beyond (what it computes for a sequence past the original length)."""
    model_dir = build_model(tmp_path_factory.mktemp("phi3_longrope"), "phi3", head_dim=16, seed=46,
                            rope_scaling=_longrope(6), max_position_embeddings=1024,
                            extra_config=dict(original_max_position_embeddings=64, partial_rotary_factor=0.75))
    short_prompts = random_prompts(2, 500, [5, 30], seed=46)
    _, outputs = _engine_outputs(model_dir, short_prompts, max_model_len=64)
    _check(model_dir, short_prompts, outputs, [hf_greedy(model_dir, p, MAX_NEW_TOKENS) for p in short_prompts])
    long_prompts = random_prompts(1, 500, [80], seed=47)
    _, outputs = _engine_outputs(model_dir, long_prompts, max_num_batched_tokens=32)
    _check(model_dir, long_prompts, outputs, [hf_greedy(model_dir, p, MAX_NEW_TOKENS) for p in long_prompts])


@pytest.mark.parametrize("hf,want", [
    (dict(model_type="mistral", num_hidden_layers=2, sliding_window=8), (8, ["sliding_attention"] * 2)),
    (dict(model_type="mistral", num_hidden_layers=2, sliding_window=None), (None, None)),
    (dict(model_type="llama", num_hidden_layers=2, sliding_window=8), (None, None)),
    (dict(model_type="qwen2", num_hidden_layers=3, sliding_window=8, use_sliding_window=False), (None, None)),
    (dict(model_type="qwen2", num_hidden_layers=3, sliding_window=8, use_sliding_window=True, max_window_layers=1),
     (8, ["full_attention", "sliding_attention", "sliding_attention"])),
    (dict(model_type="gemma3_text", num_hidden_layers=7, sliding_window=512),
     (512, ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"])),
    (dict(model_type="gemma2", num_hidden_layers=3, sliding_window=4096),
     (4096, ["sliding_attention", "full_attention", "sliding_attention"])),
])
def test_which_layers_slide(hf: dict[str, Any], want: tuple[Any, Any]) -> None:
    assert sliding_window_layers(hf) == want


def test_a_bad_window_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        sliding_window_layers(dict(model_type="mistral", num_hidden_layers=2, sliding_window=-3))


def _gemma3_shaped(num_layers: int = 26, window: int = 512) -> dict[str, Any]:
    return dict(model_type="gemma3_text", num_hidden_layers=num_layers, hidden_size=1152, num_attention_heads=4,
                num_key_value_heads=1, head_dim=256, intermediate_size=6912, vocab_size=262144,
                sliding_window=window)


def test_planner_counts_the_window() -> None:
    """Gemma 3 1B's shape (26 layers, every 6th global, window 512) at 32k: its sliding layers need 33 of
    2,048 blocks, so its KV is 17% of full attention's; pagedllm, which keeps every block of a model with
    full layers, holds all of it. A model whose every layer slides holds what the window needs."""
    from pagedllm.planner import roofline as rl

    gemma3 = rl.ModelSpec.from_hf_config(_gemma3_shaped())
    assert (gemma3.sliding_window, gemma3.num_sliding_layers) == (512, 22)
    window = rl.sliding_window_kv(gemma3, 32768, 16)
    assert window["blocks_per_sequence_in_window"] == 33
    assert window["fraction_per_layer_kv"] == pytest.approx((4 * 2048 + 22 * 33) / (26 * 2048))
    assert window["fraction_engine"] == 1.0
    mistral = rl.ModelSpec.from_hf_config(dict(_gemma3_shaped(), model_type="mistral"))
    assert rl.sliding_window_kv(mistral, 32768, 16)["fraction_engine"] == pytest.approx(33 / 2048)
    assert rl.sliding_window_kv(rl.ModelSpec.from_hf_config(dict(_gemma3_shaped(), model_type="llama")),
                                32768, 16) is None


@pytest.mark.slow
def test_blocks_in_use_at_8k_context_are_what_the_planner_predicts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One request decoding at 8k context on a random model whose every layer slides over 512 tokens holds
    ceil(512 / 16) + 1 = 33 blocks; with the window ignored, ceil(8k / 16) blocks: the planner's ratio."""
    from pagedllm.planner import roofline as rl

    context, new_tokens, block_size = 8000, 8, 16
    windowed = build_model(tmp_path_factory.mktemp("mistral8k"), "mistral", hidden_size=32, intermediate_size=64,
                           max_position_embeddings=8192, seed=48, extra_config=dict(sliding_window=512))
    prompt = random_prompts(1, 500, [context], seed=48)[0]
    held = {}
    for ignore_window in (False, True):
        if ignore_window:
            import json

            with open(f"{windowed}/config.json") as f:
                config = json.load(f)
            config["sliding_window"] = None
            with open(f"{windowed}/config.json", "w") as f:
                json.dump(config, f)
        llm = LLM(model=windowed, dtype="float32", block_size=block_size, max_num_batched_tokens=2048)
        engine = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
        in_use = []  # blocks in use after each step
        while engine.has_unfinished_requests():
            engine.step()
            kv = engine.kv_cache_manager
            in_use.append(kv.pool.num_usable_blocks - kv.num_free_blocks)
        # the decode steps: after the prompt's four 2,048-token chunks, before the request ends
        held[ignore_window] = max(in_use[4:-1])
    spec = rl.ModelSpec.from_hf_config(dict(
        model_type="mistral", num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=500, sliding_window=512))
    predicted = rl.sliding_window_kv(spec, context + new_tokens, block_size)["fraction_engine"]
    assert held[True] == -(-(context + new_tokens) // block_size)  # 501 blocks
    assert held[False] == 33
    assert held[False] / held[True] == pytest.approx(predicted)


def test_gemma3_rope_in_both_spellings() -> None:
    """Published Gemma 3 configs write rope_theta (+ rope_scaling, global layers only) and
    rope_local_base_freq; transformers 5 writes rope_parameters per layer type. Both read the same."""
    from pagedllm.models.gemma import gemma3_rope_configs

    published = dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
    new = dict(max_position_embeddings=131072, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    for hf in (published, new):
        global_rope, local_rope = gemma3_rope_configs(hf)
        assert global_rope.theta == 1_000_000.0 and global_rope.scaling["rope_type"] == "linear"
        assert global_rope.scaling["factor"] == 8.0
        assert local_rope.theta == 10_000.0 and local_rope.scaling is None


def test_a_window_hit_survives_the_eviction_of_early_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every layer sliding: a prompt's early blocks go back to the pool first and are evicted first, yet the
    same prompt later still hits the blocks its window needs, and gives transformers' tokens."""
    model_dir = build_model(tmp_path_factory.mktemp("mistral_hit"), **CASES["mistral_window"])
    prompt, other = random_prompts(2, 512, [150, 250], seed=49)
    want = hf_greedy(model_dir, prompt, MAX_NEW_TOKENS)
    # 23 blocks: the prompt's 11 come from the never-used ones; `other` (17) takes the remaining 12 and
    # then the prompt's five oldest, its first blocks, which the window gave back first.
    llm = LLM(model=model_dir, dtype="float32", seed=0, block_size=16, num_gpu_blocks_override=24,
              max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    llm.generate([prompt], params, use_tqdm=False)
    llm.generate([other], params, use_tqdm=False)
    assert llm.llm_engine.kv_cache_manager.pool.num_evictions > 0
    outputs = llm.generate([prompt], params, use_tqdm=False)
    _check(model_dir, [prompt], outputs, [want])
    assert outputs[0].num_cached_tokens == 144  # nine blocks: what the window needs of them was kept
