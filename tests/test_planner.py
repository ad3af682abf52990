"""The planner reproduces the seed's worked numbers, reads Hugging Face configs, and runs as a command."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from pagedllm.planner import roofline as rl
from pagedllm.planner.cli import PlanInputs, build_plan
from pagedllm.planner.hardware import HARDWARE_PRESETS, get_hardware, measure_cpu
from pagedllm.planner.presets import MODEL_PRESETS, load_model_spec

CONTEXT, BATCH = 64_000, 16


@pytest.fixture
def llama70b() -> rl.ModelSpec:
    spec = load_model_spec("llama-3.3-70b")
    assert (spec.num_layers, spec.head_dim, spec.num_kv_heads) == (80, 128, 8)
    return spec


# --- the seed's worked numbers -------------------------------------------------------------------


def test_h100_ridge_point_is_about_295_flops_per_byte() -> None:
    hw = HARDWARE_PRESETS["h100-sxm"]
    assert (hw.peak_flops, hw.memory_bandwidth, hw.memory_bytes) == (989e12, 3.35e12, 80e9)
    assert rl.ridge_point(hw.peak_flops, hw.memory_bandwidth) == pytest.approx(295.2, abs=0.05)
    assert round(hw.ridge_point) == 295


def test_decode_at_batch_1_in_fp16_is_1_flop_per_byte(llama70b: rl.ModelSpec) -> None:
    assert rl.decode_intensity(llama70b, batch=1, weight_dtype_bytes=2) == pytest.approx(1.0)
    # intensity grows with batch, so fp16 decode turns compute-bound at the ridge: batch 296 on an H100
    assert rl.decode_intensity(llama70b, batch=16, weight_dtype_bytes=2) == pytest.approx(16.0)
    assert rl.compute_bound_batch(llama70b, 989 / 3.35, weight_dtype_bytes=2) == math.ceil(989 / 3.35)


def test_mha_70b_kv_bytes(llama70b: rl.ModelSpec) -> None:
    mha = dataclasses.replace(llama70b, num_kv_heads=64)
    assert mha.attention_kind == "MHA"
    assert rl.kv_bytes_per_token(mha, 2) == 2_621_440
    assert round(rl.kv_cache_bytes(mha, 2, CONTEXT, BATCH) / 1e9) == 2_684


def test_gqa8_70b_kv_bytes(llama70b: rl.ModelSpec) -> None:
    assert llama70b.attention_kind == "GQA-8"
    assert rl.kv_bytes_per_token(llama70b, 2) == 327_680
    assert round(rl.kv_cache_bytes(llama70b, 2, CONTEXT, BATCH) / 1e9, 1) == 335.5


def test_gqa8_70b_kv_bytes_in_fp8(llama70b: rl.ModelSpec) -> None:
    fp8 = rl.dtype_bytes("fp8")
    assert rl.kv_bytes_per_token(llama70b, fp8) == 163_840
    assert round(rl.kv_cache_bytes(llama70b, fp8, CONTEXT, BATCH) / 1e9, 1) == 167.8


def test_kv_scale_bytes_per_token(llama70b: rl.ModelSpec) -> None:
    # one bf16 scale per row: per token, K and V of each KV head (MLA: one latent) of each layer
    assert rl.kv_scale_bytes_per_token(llama70b, "fp8") == 80 * 2 * 8 * 2
    assert rl.kv_scale_bytes_per_token(llama70b, "bfloat16") == 0
    for kv_dtype in ("fp8", "int8", "bfloat16"):
        total = rl.kv_bytes_per_token(llama70b, rl.kv_cache_element_bytes(llama70b, kv_dtype))
        elements = rl.kv_bytes_per_token(llama70b, rl.dtype_bytes(kv_dtype))
        assert total == elements + rl.kv_scale_bytes_per_token(llama70b, kv_dtype)
    mla = load_model_spec("deepseek-v3")
    assert rl.kv_scale_bytes_per_token(mla, "int8") == 61 * 2
    assert rl.kv_bytes_per_token(mla, rl.kv_cache_element_bytes(mla, "int8")) == pytest.approx(61 * (576 + 2))


def test_speculative_tokens_per_pass() -> None:
    assert round(rl.speculative_tokens_per_pass(0.8, 5), 2) == 3.69
    assert round(rl.speculative_tokens_per_pass(0.6, 5), 1) == 2.4
    assert rl.speculative_tokens_per_pass(1.0, 5) == 6.0
    assert rl.speculative_tokens_per_pass(0.0, 5) == 1.0
    with pytest.raises(ValueError, match="acceptance_rate"):
        rl.speculative_tokens_per_pass(1.5, 5)


def test_plan_reports_the_seed_numbers(llama70b: rl.ModelSpec) -> None:
    plan = build_plan(
        llama70b,
        HARDWARE_PRESETS["h100-sxm"],
        PlanInputs(context=CONTEXT, batch=BATCH, kv_cache_dtype="fp8", tp=8),
    )
    assert round(plan["roofline"]["ridge_point_flops_per_byte"]) == 295
    # The seed's 163,840 bytes of one-byte codes per token, plus the engine's 2-byte scale per 128-element
    # row (one token's K or V of one head): 80 layers x 2 x 8 heads x 130 bytes, as the pool is sized.
    assert plan["kv_cache"]["bytes_per_token"] == 166_400 == 163_840 * 130 / 128
    assert plan["kv_cache"]["bytes_per_token_per_device"] == 166_400 / 8
    assert round(plan["kv_cache"]["bytes_context_x_batch"] / 1e9, 1) == 170.4
    # ... and both parts of it: the seed's figure (per-tensor scales, as vLLM stores fp8 KV) and the scales
    kv = plan["kv_cache"]
    assert kv["element_bytes_per_token"] == 163_840 and kv["scale_bytes_per_token"] == 2_560 == 80 * 2 * 8 * 2
    assert round(kv["element_bytes_context_x_batch"] / 1e9, 1) == 167.8
    assert kv["element_bytes_context_x_batch"] + kv["scale_bytes_context_x_batch"] == kv["bytes_context_x_batch"]
    variants = plan["kv_cache"]["variants_bytes_per_token"]
    # in the run's KV dtype only (fp8 here)
    assert variants["MHA"] == {"fp8": 1_331_200} and variants["GQA-8"]["fp8"] == 166_400
    assert variants["MQA"]["fp8"] == 2 * 80 * 130
    assert round(plan["speculative"]["tokens_per_target_pass"], 2) == 3.69
    json.dumps(plan)  # JSON-ready


# --- attention variants, parameters, configs -----------------------------------------------------


def test_mla_caches_latent_plus_rope_key() -> None:
    spec = load_model_spec("deepseek-v3")
    assert spec.is_mla and spec.attention_kind == "MLA"
    assert rl.kv_bytes_per_token(spec, 2) == 61 * (512 + 64) * 2
    # the latent is not split by heads, so tensor parallelism replicates it
    assert rl.kv_bytes_per_token_per_device(spec, 2, tp=8) == rl.kv_bytes_per_token(spec, 2)


def test_mqa_kv_is_replicated_under_tp(llama70b: rl.ModelSpec) -> None:
    mqa = dataclasses.replace(llama70b, num_kv_heads=1)
    assert mqa.attention_kind == "MQA"
    assert rl.kv_bytes_per_token_per_device(mqa, 2, tp=8) == rl.kv_bytes_per_token(mqa, 2)
    assert rl.kv_bytes_per_token_per_device(llama70b, 2, tp=8) == rl.kv_bytes_per_token(llama70b, 2) / 8


@pytest.mark.parametrize(
    "name, billions, active",
    [
        ("llama-3.2-1b", 1.24, 1.24),
        ("llama-3.1-8b", 8.03, 8.03),
        ("llama-3.3-70b", 70.55, 70.55),
        ("qwen2.5-0.5b", 0.494, 0.494),
        ("qwen2.5-7b", 7.62, 7.62),
        ("deepseek-v3", 671.0, 37.6),
    ],
)
def test_parameter_counts_match_published_sizes(name: str, billions: float, active: float) -> None:
    spec = load_model_spec(name)
    assert spec.num_params is not None and spec.num_active_params is not None
    assert spec.num_params / 1e9 == pytest.approx(billions, rel=0.005)
    assert spec.num_active_params / 1e9 == pytest.approx(active, rel=0.005)


def test_parameter_count_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    spec = rl.ModelSpec.from_hf_config(tmp_path)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (2, 2, 16, "float32")
    assert spec.name == tmp_path.name


def test_from_hf_config_reads_fields() -> None:
    spec = rl.ModelSpec.from_hf_config(
        {
            "num_hidden_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 8,
            "vocab_size": 1000,
            "intermediate_size": 512,
            "torch_dtype": "float16",
            "tie_word_embeddings": True,
        }
    )
    assert spec.num_kv_heads == 8 and spec.head_dim == 32 and spec.dtype == "float16"  # MHA by default
    # head_dim given explicitly wins over hidden / heads; "dtype" (transformers 5) over "torch_dtype"
    spec = rl.ModelSpec.from_hf_config(
        {
            "num_hidden_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 1000,
            "intermediate_size": 512,
            "dtype": "bfloat16",
        }
    )
    assert spec.head_dim == 64 and spec.attention_kind == "GQA-2" and spec.dtype == "bfloat16"


def test_untied_embedding_is_not_read_by_decode() -> None:
    tied = load_model_spec("llama-3.2-1b")
    untied = dataclasses.replace(tied, tie_word_embeddings=False, num_params=None, num_active_params=None)
    embed = tied.vocab_size * tied.hidden_size
    assert untied.num_params == tied.num_params + embed
    assert rl.decode_weight_params(untied) == rl.decode_weight_params(tied)


def test_decode_bytes_per_token_counts_weights_and_kv(llama70b: rl.ModelSpec) -> None:
    weights = rl.decode_weight_params(llama70b) * 2
    kv = rl.kv_bytes_per_token(llama70b, 1) * 1000
    assert rl.decode_bytes_per_token(llama70b, 1000, 1, 2, 1) == pytest.approx(weights + kv)
    # at batch 4 the weights are shared, the KV is not
    assert rl.decode_bytes_per_token(llama70b, 1000, 4, 2, 1) == pytest.approx(weights / 4 + kv)
    # defaults come from the model's dtype (bf16) for both
    assert rl.decode_bytes_per_token(llama70b, 1000) == rl.decode_bytes_per_token(llama70b, 1000, 1, 2, 2)


def test_decode_bound_is_bandwidth_over_bytes(llama70b: rl.ModelSpec) -> None:
    hw = HARDWARE_PRESETS["h100-sxm"]
    bound = rl.decode_bound(llama70b, 1000, 1, 2, 2, hw.peak_flops, hw.memory_bandwidth)
    assert bound.limited_by == "memory"
    assert bound.tokens_per_s == pytest.approx(
        hw.memory_bandwidth / rl.decode_bytes_per_token(llama70b, 1000)
    )
    big = rl.decode_bound(llama70b, 16, 4096, 2, 2, hw.peak_flops, hw.memory_bandwidth)
    assert big.limited_by == "compute"
    # peak FLOP/s unknown (bench latency on a GPU measures only bandwidth): the memory bound alone
    unknown = rl.decode_bound(llama70b, 1000, 1, 2, 2, float("inf"), hw.memory_bandwidth)
    assert unknown.limited_by == "memory" and unknown.tokens_per_s == bound.tokens_per_s


def test_long_context_gqa_decode_never_turns_compute_bound(llama70b: rl.ModelSpec) -> None:
    assert rl.compute_bound_batch(llama70b, 295.2, 2, context_len=CONTEXT, kv_dtype_bytes=2) is None


def test_capacity_and_block_waste(llama70b: rl.ModelSpec) -> None:
    cap = rl.capacity(
        llama70b, 80e9, 0.9, tp=8, weight_dtype_bytes=2, kv_dtype_bytes=2, block_size=16, context_len=1000
    )
    kv_per_device = 72e9 - rl.weight_bytes(llama70b, 2) / 8
    assert cap.kv_memory_bytes_per_device == pytest.approx(kv_per_device)
    assert cap.num_blocks == int(kv_per_device // (327_680 / 8 * 16))
    assert cap.max_kv_tokens == cap.num_blocks * 16
    assert cap.blocks_per_sequence == 63 and cap.block_waste_tokens == 8  # 63 * 16 = 1008
    assert cap.max_sequences == cap.num_blocks // 63
    for context in range(1, 100):
        waste = rl.capacity(llama70b, 80e9, 0.9, 8, 2, 2, 16, context).block_waste_tokens
        assert 0 <= waste <= 15
    # 141 GB of bf16 weights do not fit on one 80 GB device
    assert not rl.capacity(llama70b, 80e9, 0.9, 1, 2, 2, 16, 1000).fits


def test_plan_validates_inputs(llama70b: rl.ModelSpec) -> None:
    with pytest.raises(ValueError, match="--batch"):
        build_plan(llama70b, HARDWARE_PRESETS["h100-sxm"], PlanInputs(batch=0))
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        build_plan(llama70b, HARDWARE_PRESETS["h100-sxm"], PlanInputs(gpu_memory_utilization=1.5))
    with pytest.raises(ValueError, match="unknown dtype"):
        rl.dtype_bytes("fp7")
    with pytest.raises(ValueError, match="--hardware"):
        get_hardware("tpu-v9")
    with pytest.raises(ValueError, match="--model"):
        load_model_spec("no-such-model-or-dir")


def test_cpu_is_measured() -> None:
    hw = measure_cpu()
    assert hw.measured and hw.peak_flops > 0 and hw.memory_bandwidth > 0 and hw.memory_bytes > 0


# --- the command ---------------------------------------------------------------------------------


def _run_cli(argv: list[str]) -> int:
    from pagedllm.entrypoints.cli import main

    return main(argv)


def test_plan_command_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "plan.json", tmp_path / "kv.png"
    argv = [
        "plan",
        "--model",
        "llama-3.3-70b",
        "--hardware",
        "h100-sxm",
        "--context",
        str(CONTEXT),
        "--batch",
        str(BATCH),
        "--kv-cache-dtype",
        "fp8",
        "--tp",
        "8",
        "--output-json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    assert _run_cli(argv) == 0
    table = capsys.readouterr().out
    for needle in (
        "ridge point",
        "295.2 FLOPs/byte",
        "166,400 B",  # fp8 codes (163,840) plus a 2-byte scale per 128-element row, as the engine stores them
        "170.39 GB",
        "fp8 elements                163,840 B per token, 167.77 GB",  # the seed's figure (167.8 GB)
        "scales                      2,560 B per token, 2.62 GB",
        "3.69 tokens per target pass",
        "KV bytes per token by attention variant (fp8):  MHA 1,331,200",
    ):
        assert needle in table
    plan = json.loads(out_json.read_text())
    assert plan["kv_cache"]["bytes_per_token"] == 166_400
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert _run_cli(["plan", "--model", "qwen2.5-7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["attention"] == "GQA-4"
    # a 16-bit cache has no scales: no split
    assert _run_cli(["plan", "--model", "llama-3.3-70b", "--context", str(CONTEXT), "--batch", str(BATCH)]) == 0
    table = capsys.readouterr().out
    assert "327,680 B" in table and "335.54 GB" in table and "scales" not in table


def test_plan_command_on_local_config_and_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({**MODEL_PRESETS["qwen2.5-0.5b"], "torch_dtype": "float32"})
    )
    assert (
        _run_cli(["plan", "--model", str(tmp_path), "--hardware", "cpu", "--context", "256", "--json"]) == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["hardware"]["measured"] and plan["model"]["weight_dtype"] == "float32"
    assert plan["decode"]["tokens_per_s"] > 0


def test_plan_command_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(["plan", "--acceptance-rate", "2"]) == 2
    assert "--acceptance-rate" in capsys.readouterr().err


def test_disaggregation_section_by_hand() -> None:
    """Llama-3.1-8B in bf16, 4,096-token prompt over a 50 GB/s link: 131,072 B of KV per token (GQA-8,
    32 layers, 128 dims, K and V); colocated decode steps carry a 2,048-token chunk each, disaggregated
    ones do not."""
    spec, hw = load_model_spec("llama-3.1-8b"), HARDWARE_PRESETS["h100-sxm"]
    plan = build_plan(spec, hw, PlanInputs(context=8192, batch=32, link_gbs=50.0, prompt_len=4096))
    d = plan["disaggregation"]
    assert d["kv_bytes"] == 131_072 * 4096
    assert d["transfer_s"] == pytest.approx(131_072 * 4096 / 50e9)
    assert d["prefill_s"] == pytest.approx(rl.prefill_flops(spec, 4096) / hw.peak_flops)
    assert d["colocated_stalled_steps"] == 2
    assert d["colocated_itl_s"] == pytest.approx(d["decode_step_s"] + d["prefill_s"] / 2)
    assert d["decode_step_s"] < d["disaggregated_itl_s"] < d["colocated_itl_s"]
    assert d["disaggregated_ttft_s"] == pytest.approx(d["prefill_s"] + d["transfer_s"] + d["decode_step_s"])
    assert "disaggregation" not in build_plan(spec, hw, PlanInputs(context=8192, batch=32))
    with pytest.raises(ValueError, match="--link-gbs"):
        PlanInputs(link_gbs=0.0).validate()


def test_a_file_that_is_no_config_gets_an_error_that_names_the_parameter(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="--model .* neither a config.json nor a .gguf file"):
        load_model_spec(str(binary))
