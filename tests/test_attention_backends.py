"""Attention backends in the engine: choosing one, and the same greedy tokens from every backend.

The reference is TORCH_SDPA (K/V gathered through the block tables, then SDPA). Each other backend must
produce the same greedy tokens token for token in fp32, and logprobs equal within 1e-4, through
chunked prefill over a cached prefix, prefix-cache hits on shared blocks, and batched decode.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_model, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.attention.selector import ENV_VAR, get_attn_backend, resolve_backend_name

CPU = torch.device("cpu")

PARITY_MODELS = {
    "llama_gqa": dict(arch="llama", num_key_value_heads=2, head_dim=32, seed=12),
    "llama_mqa": dict(arch="llama", num_key_value_heads=1, seed=11),
    "qwen2_bias_tied": dict(arch="qwen2", tie_word_embeddings=True, seed=16),
    # Sliding windows (20 tokens, through blocks) on local layers and attention soft-capping.
    "gemma2_window_soft_cap": dict(arch="gemma2", head_dim=16, seed=17,
                                   extra_config=dict(sliding_window=20, attn_logit_softcapping=2.0)),
}


def _generate(model_dir: str, backend: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    # A 48-token budget splits the long prompts into chunks, so later chunks attend to a cached prefix;
    # the shared prefix gives prefix-cache hits; block size 16 puts boundaries inside every prompt.
    llm = LLM(model=model_dir, dtype="float32", seed=0, attention_backend=backend, max_num_batched_tokens=48,
              block_size=16)
    assert llm.llm_engine.model_runner.backend.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outputs]


@pytest.mark.parametrize("case", list(PARITY_MODELS))
def test_backends_give_the_reference_tokens(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = build_model(tmp_path_factory.mktemp(case), **PARITY_MODELS[case])
    base = random_prompts(4, 500, [5, 40, 100, 150], seed=3)
    shared = base[3][:96]
    prompts = base + [shared + [7, 8, 9], shared + [10] * 30]
    reference = _generate(model_dir, "TORCH_SDPA", prompts)
    for backend in ("CPU_FLASH", "TORCH_FLASH"):
        got = _generate(model_dir, backend, prompts)
        for (want_ids, want_lps), (got_ids, got_lps) in zip(reference, got):
            assert got_ids == want_ids, f"{backend} differs from TORCH_SDPA"
            assert got_lps == pytest.approx(want_lps, abs=1e-4)


def test_selection_order_engine_arg_then_env_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend_name(None, CPU, torch.float32) == "CPU_FLASH"  # this machine has a compiler
    monkeypatch.setenv(ENV_VAR, "torch_sdpa")
    assert resolve_backend_name(None, CPU, torch.float32) == "TORCH_SDPA"
    assert resolve_backend_name("TORCH_FLASH", CPU, torch.float32) == "TORCH_FLASH"
    assert resolve_backend_name("auto", CPU, torch.float32) == "CPU_FLASH"
    backend = get_attn_backend(None, 4, 2, 8, torch.float32, torch.float32, CPU)
    assert backend.name == "TORCH_SDPA" and backend.needs_dense_masks


def test_bad_backend_names_are_value_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend_name("FLASHINFER", CPU, torch.float32)
    with pytest.raises(ValueError, match="attention_backend=TRITON"):
        resolve_backend_name("TRITON", CPU, torch.float32)
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend_name(None, CPU, torch.float32)


def test_engine_rejects_an_unknown_backend(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model=tiny_llama_dir, attention_backend="NOPE")


def test_fp8_cache_through_the_cpu_kernel_matches_the_reference(tiny_llama_dir: str) -> None:
    # The kernel widens fp8 K/V per tile; the reference widens the gathered copy: same values, same tokens.
    prompts = random_prompts(2, 500, [30, 70], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("TORCH_SDPA", "CPU_FLASH"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_dtype="fp8", attention_backend=backend)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["CPU_FLASH"] == tokens["TORCH_SDPA"]


def test_bench_attention_runs_and_writes_json(tiny_llama_dir: str, tmp_path) -> None:
    import json

    from pagedllm.entrypoints.cli import build_parser

    out = tmp_path / "attention.json"
    args = build_parser().parse_args([
        "bench", "attention", "--model", tiny_llama_dir, "--contexts", "40", "--batch-sizes", "1,2",
        "--prefill", "64,20", "--num-iters", "1", "--bandwidth-mib", "16", "--e2e-context", "48",
        "--e2e-output-len", "2", "--output-json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "CPU_FLASH"
    assert report["decode_path"] in ("amx_bf16", "avx512_bf16", "avx512", "generic")
    assert [(r["kind"], r["batch"]) for r in report["kernels"]] == [("decode", 1), ("decode", 2), ("prefill", 1)]
    assert all(r["backend_ms"] > 0 and r["kv_bytes"] > 0 for r in report["kernels"])
    assert [r["batch"] for r in report["e2e"]] == [1, 2] and all(r["backend_tok_s"] > 0 for r in report["e2e"])


def test_triton_block_size_is_checked_when_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # stands in for a CUDA device
    assert resolve_backend_name("TRITON", CPU, torch.bfloat16, block_size=16) == "TRITON"
    with pytest.raises(ValueError, match="block_size"):
        resolve_backend_name("TRITON", CPU, torch.bfloat16, block_size=8)
    # One-byte caches: the blocks a step reads are dequantized for the kernels (tests/test_kv_cache_quant.py).
    assert resolve_backend_name("TRITON", CPU, torch.float8_e4m3fn, block_size=16) == "TRITON"
