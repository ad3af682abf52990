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
from pagedllm.config import kv_cache_groups, sliding_window_layers

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
    # Models mixing full and sliding layers keep them in separate KV cache groups.
    config = llm.llm_engine.model_config
    mixed = config.uniform_sliding_window is None
    assert (llm.llm_engine.cache_config.kv_cache_groups is not None) == mixed
    assert llm.llm_engine.kv_cache_manager.num_groups == (len(config.layer_types) if mixed else 1)
    _check(model_dir, prompts, outputs, want)
    again = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                                                 logprobs=1), use_tqdm=False)
    _check(model_dir, prompts, again, want)
    metrics = metric_values(llm)
    assert metrics["pagedllm:prefix_cache_hits"] > 0
    # Blocks behind the window went back to the pool as requests moved on (in a model with full layers,
    # those of the sliding layers' KV cache groups); at the end every block is free again.
    assert metrics["pagedllm:kv_blocks_freed_by_window"] > 0
    assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]

    # A pool too small for all requests at once: preempted requests recompute to the same tokens. With
    # KV cache groups a block holds one group's layers, and a sliding group gives its blocks back, so the
    # pool has more (and more than the longest prompt needs alone in one chunk: 6 blocks per group).
    num_groups = llm.llm_engine.kv_cache_manager.num_groups
    tight, outputs = _engine_outputs(model_dir, prompts, max_num_batched_tokens=128,
                                     num_gpu_blocks_override=8 if num_groups == 1 else 4 * num_groups + 8)
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


def test_llama_longrope_takes_the_same_factor_set(tmp_path_factory: pytest.TempPathFactory) -> None:
    """LongRoPE on a Llama checkpoint: the factor set is chosen as for Phi-3 (it took the short set always)."""
    model_dir = build_model(tmp_path_factory.mktemp("llama_longrope"), "llama", seed=48, rope_scaling={
        **_longrope(8), "original_max_position_embeddings": 32}, max_position_embeddings=1024)
    long_prompts = random_prompts(1, 500, [40], seed=48)
    _, outputs = _engine_outputs(model_dir, long_prompts, max_model_len=128)
    _check(model_dir, long_prompts, outputs, [hf_greedy(model_dir, p, MAX_NEW_TOKENS) for p in long_prompts])


def test_dynamic_ntk_rope_is_plain_rope_within_the_original_length(tmp_path_factory: pytest.TempPathFactory) -> None:
    """rope_type "dynamic" (it was refused): within max_position_embeddings the reference computes plain
    RoPE, and so does an engine whose max_model_len is within it; past it, the base is fixed per engine."""
    model_dir = build_model(tmp_path_factory.mktemp("llama_dynamic"), "llama", seed=49,
                            rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=96)
    prompts = random_prompts(2, 500, [5, 70], seed=49)
    _, outputs = _engine_outputs(model_dir, prompts, max_model_len=96)
    _check(model_dir, prompts, outputs, [hf_greedy(model_dir, p, MAX_NEW_TOKENS) for p in prompts])
    llm, _ = _engine_outputs(model_dir, prompts[:1], max_model_len=192)  # past it: a larger base, no refusal
    assert llm.llm_engine.model_config.max_model_len == 192


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
    2,048 blocks, so its KV is 17% of full attention's, and pagedllm holds that much in 13 KV cache groups
    of 2 layers (all of it where groups are off). A model whose every layer slides holds what the window
    needs."""
    from pagedllm.planner import roofline as rl

    gemma3 = rl.ModelSpec.from_hf_config(_gemma3_shaped())
    assert (gemma3.sliding_window, gemma3.num_sliding_layers) == (512, 22)
    window = rl.sliding_window_kv(gemma3, 32768, 16)
    assert window["blocks_per_sequence_in_window"] == 33
    assert window["fraction_per_layer_kv"] == pytest.approx((4 * 2048 + 22 * 33) / (26 * 2048))
    assert window["fraction_engine"] == window["fraction_per_layer_kv"]  # full and sliding groups
    assert window["num_kv_cache_groups"] == 13  # of gcd(4, 22) = 2 layers
    assert window["fraction_engine_without_groups"] == 1.0
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


def test_kv_cache_groups_have_one_size_and_one_kind_each() -> None:
    """Groups of gcd(full, sliding) layers: Gemma 3 1B's 4 full and 22 sliding layers make 2 full groups
    and 11 sliding groups of 2; Gemma 2's alternation makes one of each; all-alike models have none."""
    _, types = sliding_window_layers(_gemma3_shaped())
    groups = kv_cache_groups(512, types)
    assert [len(layers) for _, layers in groups] == [2] * 13
    assert [window for window, _ in groups] == [None] * 2 + [512] * 11
    assert groups[0][1] == [5, 11] and sorted(i for _, layers in groups for i in layers) == list(range(26))
    assert kv_cache_groups(4, ["sliding_attention", "full_attention"] * 3) == [
        (None, [1, 3, 5]), (4, [0, 2, 4])]
    assert kv_cache_groups(4, ["sliding_attention"] * 3) is None
    assert kv_cache_groups(None, None) is None


@pytest.mark.slow
def test_gemma3_kv_at_8k_context_is_what_the_planner_predicts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A random Gemma-3-shaped model (one full layer to five sliding ones, window 512) decoding at 8k
    context: the full group holds ceil(8k / 16) blocks, each sliding group ceil(512 / 16) + 1; in bytes
    that is the planner's fraction of the same model run with --ignore-sliding-window (one group of every
    layer, every block kept)."""
    import json

    from pagedllm.benchmarks.latency import _decode_kv, _kv_run_tokens
    from pagedllm.planner import roofline as rl

    context, new_tokens, block_size = 8000, 8, 16
    model_dir = build_model(tmp_path_factory.mktemp("gemma3_8k"), "gemma3", num_hidden_layers=6, hidden_size=32,
                            intermediate_size=64, head_dim=16, max_position_embeddings=8192, seed=50,
                            extra_config=dict(sliding_window=512, sliding_window_pattern=6))
    prompt = random_prompts(1, 500, [context], seed=50)[0]
    held = {}
    for ignore in (False, True):
        llm = LLM(model=model_dir, dtype="float32", block_size=block_size, max_num_batched_tokens=2048,
                  ignore_sliding_window=ignore)
        held[ignore] = _decode_kv(llm, prompt, new_tokens)
        engine = llm.llm_engine
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.pool.num_usable_blocks
    full_blocks = -(-(context + _kv_run_tokens(new_tokens) - 2) // block_size)  # 501
    assert held[True][:2] == (full_blocks, 6)
    assert held[False][:2] == (full_blocks + 5 * (512 // block_size + 1), 1)
    with open(f"{model_dir}/config.json") as f:
        spec = rl.ModelSpec.from_hf_config(json.load(f))
    predicted = rl.sliding_window_kv(spec, context + _kv_run_tokens(new_tokens) - 1, block_size)["fraction_engine"]
    assert held[False][2] / held[True][2] == pytest.approx(predicted)


def test_bench_latency_reports_the_kv_the_window_saves(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`bench latency` with and without --ignore-sliding-window: the KV a decoding request holds, in bytes,
    is in the planner's ratio (the owner's measurement at 8k context, in miniature)."""
    import json

    from pagedllm.entrypoints.cli import main

    model_dir = build_model(tmp_path_factory.mktemp("gemma3_bench"), "gemma3", num_hidden_layers=6, hidden_size=32,
                            intermediate_size=64, head_dim=16, seed=51,
                            extra_config=dict(sliding_window=64, sliding_window_pattern=6))
    reports = {}
    for flags in ([], ["--ignore-sliding-window"]):
        out = tmp_path_factory.mktemp("bench") / "latency.json"
        assert main(["bench", "latency", "--model", model_dir, "--dtype", "float32", "--max-model-len", "1024",
                     "--input-len", "600", "--output-len", "8", "--num-iters", "1", "--num-iters-warmup", "0",
                     "--output-json", str(out), *flags]) == 0
        reports[bool(flags)] = json.loads(out.read_text())
    windowed, full = reports[False], reports[True]
    assert (windowed["kv_layers_per_block"], full["kv_layers_per_block"]) == (1, 6)
    assert windowed["decode_kv_blocks"] == full["decode_kv_blocks"] + 5 * (64 // 16 + 1)  # 5 sliding groups
    assert windowed["decode_kv_bytes"] / full["decode_kv_bytes"] == pytest.approx(
        windowed["planner_sliding_window_kv_fraction"])
    assert windowed["planner_sliding_window_kv_fraction"] < 0.5


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


def test_a_request_no_pool_can_hold_is_refused_not_left_waiting(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With KV cache groups a request holds blocks in every group: one whose full groups' tokens (or whose
    first prefill chunk in every group) exceed the pool is a ValueError at add time, never a request that
    waits forever, and the engine serves the next one."""
    model_dir = build_model(tmp_path_factory.mktemp("gemma3_small_pool"), **CASES["gemma3"])
    llm = LLM(model=model_dir, dtype="float32", seed=0, block_size=16, num_gpu_blocks_override=10,
              max_num_batched_tokens=32)
    assert llm.llm_engine.cache_config.kv_cache_groups is not None
    num_groups = llm.llm_engine.kv_cache_manager.num_groups
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    too_long = [5] * (16 * 10)  # more blocks than the pool in the full group alone
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        llm.generate([too_long], params, use_tqdm=False)
    # 88 tokens: 6 blocks in the full group, which the pool has, but 3 more in each sliding group
    assert num_groups == 3
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        llm.generate([[5] * 80], params, use_tqdm=False)
    out = llm.generate([[5] * 8], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    assert metric_values(llm)["pagedllm:kv_cache_free_blocks"] == metric_values(llm)["pagedllm:kv_cache_total_blocks"]


def test_a_request_longer_than_the_pool_fits_when_every_layer_slides(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every layer sliding: blocks behind the window go back to the pool, so admission counts the window
    too, and a request longer than the pool (but not its window) runs, with transformers' tokens."""
    model_dir = build_model(tmp_path_factory.mktemp("mistral_long"), **CASES["mistral_window"])
    prompt = random_prompts(1, 512, [150], seed=51)[0]
    want = hf_greedy(model_dir, prompt, MAX_NEW_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", seed=0, block_size=16, num_gpu_blocks_override=8,
              max_num_batched_tokens=32)
    assert llm.llm_engine.cache_config.group_windows[0] is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([prompt], params, use_tqdm=False)  # 150 + 32 tokens: 12 blocks, in a pool of 8
    _check(model_dir, [prompt], outputs, [want])
    assert metric_values(llm)["pagedllm:kv_cache_free_blocks"] == metric_values(llm)["pagedllm:kv_cache_total_blocks"]
