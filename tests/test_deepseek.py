"""DeepSeek-V2/V3 with multi-head latent attention over a paged latent cache (issue 12).

Parity with transformers on random small configs (MLA with and without q_lora_rank, YaRN with
DeepSeek's mscale on and off, MoE with several experts and groups, first_k_dense_replace dense
layers), under chunked prefill and mixed prompt lengths; absorbed decode against expanded decode;
KV bytes per token from one formula in the engine, its log and the planner; bad configs rejected.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_moe import check_parity
from tiny_models import build_model, hf_logits, metric_values, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.mla import TorchMLAAttention
from pagedllm.config import ModelConfig
from pagedllm.planner.roofline import ModelSpec, kv_bytes_per_token, kv_cache_element_bytes

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

MLA_FIELDS = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
                  moe_intermediate_size=32, num_experts_per_tok=2)


def deepseek_case(arch: str, seed: int, rope_scaling: dict[str, Any] | None = None, **fields: Any
                  ) -> dict[str, Any]:
    return dict(arch=arch, seed=seed, num_hidden_layers=3, num_key_value_heads=4, rope_scaling=rope_scaling,
                extra_config={**MLA_FIELDS, **fields})


DEEPSEEK_CASES: dict[str, dict[str, Any]] = {
    "v2_q_lora_greedy": deepseek_case("deepseek_v2", 50, q_lora_rank=24, n_routed_experts=6,
                                      topk_method="greedy", first_k_dense_replace=1, n_shared_experts=1),
    "v2_no_q_lora_group_limited_yarn": deepseek_case(
        "deepseek_v2", 51, rope_scaling=YARN, q_lora_rank=None, n_routed_experts=8, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", first_k_dense_replace=1, n_shared_experts=2,
        routed_scaling_factor=2.0),
    "v3_q_lora_yarn": deepseek_case("deepseek_v3", 52, rope_scaling=YARN, q_lora_rank=24, n_routed_experts=8,
                                    n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                    norm_topk_prob=True, routed_scaling_factor=2.5),
    "v3_no_q_lora_rotate_half": deepseek_case("deepseek_v3", 53, q_lora_rank=None, n_routed_experts=8,
                                              n_group=2, topk_group=1, first_k_dense_replace=2,
                                              n_shared_experts=1, rope_interleave=False, norm_topk_prob=False),
}


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_deepseek_greedy_parity_with_transformers(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = DEEPSEEK_CASES[case]
    check_parity(build_model(tmp_path_factory.mktemp(case), **spec), spec["seed"])


# ---- the paged latent cache under the engine's block-level machinery ----

@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model(tmp_path_factory.mktemp("v3_engine"), **DEEPSEEK_CASES["v3_q_lora_yarn"])


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("engine_args", [
    pytest.param(dict(enable_prefix_caching=True), id="prefix_cache"),
    pytest.param(dict(block_size=16, num_gpu_blocks_override=9, enable_prefix_caching=True), id="preemption"),
    pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3}), id="ngram_spec"),
    pytest.param(dict(max_num_batched_tokens=8), id="chunk_8"),
])
def test_latent_cache_outputs_do_not_depend_on_scheduling(v3_dir: str, engine_args: dict[str, Any]) -> None:
    """Shared prefixes (block reuse and copy-on-write of a partial last block), preemption, speculative
    decoding and chunk size all leave the greedy tokens of each prompt run alone unchanged."""
    base = random_prompts(1, 500, [40], seed=7)[0]
    prompts = [base[:n] + tail for n, tail in ((40, []), (33, [5, 6]), (16, [7] * 9), (40, [9, 8, 7]))]
    prompts.append(random_prompts(1, 500, [23], seed=8)[0] * 2)  # repetitive: n-gram drafts get accepted
    alone = LLM(model=v3_dir, dtype="float32", enable_prefix_caching=False, max_model_len=128)
    want = [_greedy(alone, [p])[0] for p in prompts]
    llm = LLM(model=v3_dir, dtype="float32", max_model_len=128, **engine_args)
    assert _greedy(llm, prompts) == want
    assert _greedy(llm, prompts) == want  # again, now with every full block cached
    metrics = metric_values(llm)
    assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
    if "num_gpu_blocks_override" in engine_args:
        assert metrics["pagedllm:num_preemptions"] > 0


# ---- absorbed decode against expanded decode ----

def test_absorbed_decode_equals_expanded_decode() -> None:
    torch.manual_seed(3)
    heads, rank, rope, nope, v_dim, block_size, num_blocks = 8, 64, 16, 32, 48, 16, 12
    mla = TorchMLAAttention(heads, rank, rope, torch.float32)
    cache = torch.randn(1, 1, num_blocks, block_size, rank + rope)
    kv_b = torch.randn(heads * (nope + v_dim), rank) * rank ** -0.5
    scale = (nope + rope) ** -0.5
    seq_lens = [5, 37, 16, 120]
    tables = torch.stack([torch.randperm(num_blocks)[:8] for _ in seq_lens])
    key_pos = torch.arange(8 * block_size)
    visible = key_pos[None, :] < torch.tensor(seq_lens)[:, None]
    mask = torch.where(visible, 0.0, float("-inf"))[:, None, None, :]
    n = len(seq_lens)
    slots = torch.stack([tables[i, (s - 1) // block_size] * block_size + (s - 1) % block_size
                         for i, s in enumerate(seq_lens)])
    batched = AttentionMetadata(slot_mapping=slots, num_decode_tokens=n, num_decodes=n, decode_block_tables=tables,
                                decode_attn_mask=mask)
    single = AttentionMetadata(slot_mapping=slots[3:], num_decode_tokens=1, num_decodes=1,
                               decode_block_tables=tables[3:], decode_seq_len=seq_lens[3])
    for metadata, rows in ((batched, slice(0, n)), (single, slice(3, 4))):
        q_nope, q_pe = torch.randn(n, heads, nope)[rows], torch.randn(n, heads, rope)[rows]
        latent = torch.randn(n, rank + rope)[rows]
        outs = []
        for absorbed in (True, False):
            mla.absorbed_decode = absorbed
            outs.append(mla.forward_mla(q_nope, q_pe, latent, cache.clone(), metadata, scale, kv_b, v_dim))
        rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
        assert rel < 1e-4, rel
        assert (outs[0] - outs[1]).abs().max() <= 1e-4 * outs[1].abs().max()


# ---- KV sizing: one formula for the pool, the start-up log and the planner ----

def test_mla_kv_bytes_per_token_pool_log_and_planner(v3_dir: str) -> None:
    hf = json.loads((Path(v3_dir) / "config.json").read_text())
    layers, rank, rope = hf["num_hidden_layers"], hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    heads, qk_dim, v_dim = hf["num_attention_heads"], hf["qk_nope_head_dim"] + rope, hf["v_head_dim"]
    config = ModelConfig.from_pretrained(v3_dir, dtype="float32")
    for kv_dtype, element in ((torch.float32, 4), (torch.bfloat16, 2)):
        want = (rank + rope) * layers * element
        assert config.kv_bytes_per_token(kv_dtype) == want
        assert kv_bytes_per_token(ModelSpec.from_hf_config(v3_dir), element) == want

    budget = 1 << 20
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    runner_logger = logging.getLogger("pagedllm.worker.model_runner")
    runner_logger.addHandler(handler)
    try:
        llm = LLM(model=v3_dir, dtype="float32", kv_cache_memory_bytes=budget, max_model_len=128)
    finally:
        runner_logger.removeHandler(handler)
    assert any(f"{(rank + rope) * layers * 4} bytes per token, MLA latent" in r for r in records), records
    runner = llm.llm_engine.model_runner
    assert tuple(runner.kv_caches[0].shape)[-1] == rank + rope
    assert runner.kv_caches[0].numel() * 4 == llm.llm_engine.cache_config.num_blocks * 16 * (rank + rope) * 4
    # The same budget with MHA-expanded K/V (K: heads x (nope + rope), V: heads x v_head_dim per layer).
    assert qk_dim == v_dim, "the test config makes expanded K and V the same width"
    expanded = dataclasses.replace(config, kv_lora_rank=None, num_key_value_heads=heads, head_dim=qk_dim)
    mla_tokens = budget // config.kv_bytes_per_token(torch.float32)
    mha_tokens = budget // expanded.kv_bytes_per_token(torch.float32)
    assert llm.llm_engine.cache_config.num_blocks == mla_tokens // 16
    assert mla_tokens / mha_tokens == pytest.approx(2 * heads * qk_dim / (rank + rope), rel=0.01)


# ---- bad configs fail at load, naming the field ----

@pytest.mark.parametrize("field,value,arch", [
    ("topk_method", "sparse_sinkhorn", "deepseek_v2"),
    ("scoring_func", "relu", "deepseek_v3"),
    ("topk_method", "greedy", "deepseek_v3"),
    ("scoring_func", "sigmoid", "deepseek_v2"),
    ("norm_topk_prob", True, "deepseek_v2"),
    ("moe_layer_freq", 2, "deepseek_v3"),
    ("attention_bias", True, "deepseek_v2"),
    ("n_group", 3, "deepseek_v3"),
])
def test_unservable_config_is_a_load_time_error(field: str, value: Any, arch: str, tmp_path: Path) -> None:
    case = "v3_q_lora_yarn" if arch == "deepseek_v3" else "v2_no_q_lora_group_limited_yarn"
    model_dir = build_model(tmp_path, **{**DEEPSEEK_CASES[case], "num_hidden_layers": 2})
    path = Path(model_dir) / "config.json"
    hf = json.loads(path.read_text())
    hf[field] = value
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=field):
        LLM(model=model_dir, dtype="float32", max_model_len=64)


def test_bench_mla_runs_and_reports_the_planners_kv_bytes(tmp_path: Path) -> None:
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "mla.json"
    assert main(["bench", "mla", "--contexts", "40", "--batch", "2", "--steps", "1", "--num-layers", "1",
                 "--dtype", "float32", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["decode"] for r in report["decode"]} == {"absorbed", "expanded"}
    assert all(r["relative_difference"] < 1e-4 for r in report["decode"])  # fp32: the two forms agree
    mla, mha = report["kv_bytes_per_token"]
    assert mla["engine_bytes_per_token"] == mla["plan_bytes_per_token"] == (512 + 64) * 1 * 4
    assert mha["engine_bytes_per_token"] == mha["plan_bytes_per_token"] == 2 * 16 * 128 * 1 * 4


def test_fp8_kv_cache_stores_the_latent_in_one_byte(v3_dir: str) -> None:
    """kv_cache_dtype='fp8' applies to the latent and rope key: one byte per element plus a 2-byte scale per
    token's latent row, close logprobs."""
    prompt = random_prompts(1, 500, [37], seed=9)[0]
    llm = LLM(model=v3_dir, dtype="float32", kv_cache_dtype="fp8", max_model_len=128)
    runner = llm.llm_engine.model_runner
    assert runner.kv_caches[0].dtype == torch.uint8  # codes and bf16 scales, see kv_cache/quant.py
    config = llm.llm_engine.model_config
    row = config.kv_lora_rank + config.qk_rope_head_dim
    assert runner.kv_cache_bytes_per_block() == config.num_hidden_layers * (row + 2) * 16
    assert kv_bytes_per_token(ModelSpec.from_hf_config(v3_dir), kv_cache_element_bytes(
        ModelSpec.from_hf_config(v3_dir), "fp8")) == pytest.approx(config.num_hidden_layers * (row + 2))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1), use_tqdm=False)
    token = out[0].outputs[0].token_ids[0]
    want = torch.log_softmax(hf_logits(v3_dir, prompt)[-1], dim=-1)[token].item()
    # e4m3 keeps 3 mantissa bits; on this random model the first logprob moves by about 0.2.
    assert out[0].outputs[0].logprobs[0][token].logprob == pytest.approx(want, abs=0.5)


def test_weight_quantization_is_rejected_not_ignored(v3_dir: str) -> None:
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=v3_dir, dtype="float32", quantization="int8", max_model_len=64)


@pytest.mark.parametrize("kv_cache_dtype,calculate_kv_scales,tolerance",
                         [("int8", False, 0.1), ("fp8_e5m2", False, 2.5), ("fp8", True, 0.5)])
def test_one_byte_latent_cache_kinds(v3_dir: str, kv_cache_dtype: str, calculate_kv_scales: bool,
                                     tolerance: float) -> None:
    """Every one-byte kind (and per-layer static scales) stores the latent row with its scale; cold and
    prefix-cached runs agree, and the first logprob stays near the fp32 model's (measured on this random
    model: int8 0.05, e4m3 0.04, e5m2 1.8, where e5m2's 2 mantissa bits flip its greedy token)."""
    prompt = random_prompts(1, 500, [37], seed=9)[0]
    llm = LLM(model=v3_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
              max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1)
    cold, cached = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert cold.token_ids == cached.token_ids
    assert [lp[t].logprob for lp, t in zip(cold.logprobs, cold.token_ids)] == \
        pytest.approx([lp[t].logprob for lp, t in zip(cached.logprobs, cached.token_ids)], abs=1e-5)
    token = cold.token_ids[0]
    want = torch.log_softmax(hf_logits(v3_dir, prompt)[-1], dim=-1)[token].item()
    assert cold.logprobs[0][token].logprob == pytest.approx(want, abs=tolerance)
    if calculate_kv_scales:
        assert len(llm.llm_engine.model_runner.model.mla.static_scales) == llm.llm_engine.model_config.num_hidden_layers
