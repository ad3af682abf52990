"""Mixture-of-experts models (issue 12): Mixtral and Qwen3-MoE against transformers, and the routing
functions against transformers' routers on the same logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_parity import assert_greedy_matches
from tiny_models import build_model, hf_greedy, hf_logits, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.models.moe import MoEConfig, fused_experts, select_experts

PROMPT_LENGTHS = [1, 5, 16, 17, 40, 75]
MAX_NEW_TOKENS = 12


def check_parity(model_dir: str, seed: int, **llm_kwargs: Any) -> None:
    """Greedy tokens equal transformers' for a mixed batch, with prefill chunked by a small budget."""
    vocab_size = hf_logits(model_dir, [3]).shape[-1]
    prompts = random_prompts(len(PROMPT_LENGTHS), vocab_size, PROMPT_LENGTHS, seed=seed)
    llm_kwargs.setdefault("max_num_batched_tokens", 32)  # the 40- and 75-token prompts prefill in chunks
    llm = LLM(model=model_dir, dtype="float32", seed=0, max_model_len=256, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        want, _ = hf_greedy(model_dir, prompt, MAX_NEW_TOKENS)
        assert_greedy_matches(model_dir, prompt, list(out.outputs[0].token_ids), want)


MOE_CASES: dict[str, dict[str, Any]] = {
    "mixtral": dict(arch="mixtral", seed=40, extra_config=dict(num_local_experts=6, num_experts_per_tok=2)),
    "qwen3_moe_norm_topk": dict(arch="qwen3_moe", head_dim=32, seed=41, extra_config=dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True)),
    # A dense layer among sparse ones (mlp_only_layers), and unnormalized top-k weights.
    "qwen3_moe_dense_layer": dict(arch="qwen3_moe", num_hidden_layers=3, seed=42, extra_config=dict(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        mlp_only_layers=[1])),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_greedy_parity_with_transformers(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = MOE_CASES[case]
    check_parity(build_model(tmp_path_factory.mktemp(case), **spec), spec["seed"])


def _hf_router(model_type: str, **fields: Any) -> tuple[torch.nn.Module, MoEConfig]:
    import transformers

    classes = {"deepseek_v2": ("DeepseekV2Config", "deepseek_v2.modeling_deepseek_v2", "DeepseekV2TopkRouter"),
               "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter")}
    config_name, module, router = classes[model_type]
    config = getattr(transformers, config_name)(hidden_size=16, num_attention_heads=2, **fields)
    import importlib

    hf_router = getattr(importlib.import_module(f"transformers.models.{module}"), router)(config)
    torch.nn.init.normal_(hf_router.weight, std=1.0)
    if hasattr(hf_router, "e_score_correction_bias"):
        hf_router.e_score_correction_bias.normal_(std=0.5)
    return hf_router, MoEConfig.from_hf(config.to_dict(), model_type)


@pytest.mark.parametrize("model_type,fields", [
    ("deepseek_v2", dict(n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy",
                         routed_scaling_factor=1.5)),
    ("deepseek_v2", dict(n_routed_experts=12, num_experts_per_tok=3, topk_method="group_limited_greedy",
                         n_group=4, topk_group=2, routed_scaling_factor=16.0, moe_intermediate_size=8)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                         norm_topk_prob=True, routed_scaling_factor=2.5, moe_intermediate_size=8)),
    ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                         norm_topk_prob=False, moe_intermediate_size=8)),
], ids=["v2_greedy", "v2_group_limited", "v3_noaux_tc_norm", "v3_noaux_tc_raw"])
@torch.no_grad()
def test_routing_matches_transformers(model_type: str, fields: dict[str, Any]) -> None:
    torch.manual_seed(0)
    hf_router, cfg = _hf_router(model_type, **fields)
    hidden = torch.randn(64, 16)
    _, want_weights, want_ids = hf_router(hidden)
    logits = torch.nn.functional.linear(hidden, hf_router.weight)
    bias = getattr(hf_router, "e_score_correction_bias", None)
    weights, ids = select_experts(logits, cfg, bias)
    # Same experts per token (order within the k may differ), same weight for each expert.
    got = {(t, int(e)): float(w) for t in range(64) for e, w in zip(ids[t], weights[t])}
    want = {(t, int(e)): float(w) for t in range(64) for e, w in zip(want_ids[t], want_weights[t])}
    assert got.keys() == want.keys()
    for key in got:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7)


def test_fused_experts_equal_a_per_token_loop() -> None:
    """Grouping rows by expert computes exactly what each token's own top-k sum would."""
    torch.manual_seed(1)
    num_tokens, hidden, inter, experts, k = 37, 16, 24, 6, 2
    x = torch.randn(num_tokens, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k)

    def act_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    got = fused_experts(x, w13, w2, weights, ids, act_and_mul)
    want = torch.stack([sum(weights[t, j] * (w2[ids[t, j]] @ act_and_mul(w13[ids[t, j]] @ x[t]))
                            for j in range(k)) for t in range(num_tokens)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_tensor_parallel_moe_is_refused_naming_the_option(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Experts and MLA have no sharded form yet: TP > 1 is a ValueError before any worker starts."""
    spec = MOE_CASES["mixtral"]
    model_dir = build_model(tmp_path_factory.mktemp("mixtral_tp"), **spec)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=model_dir, dtype="float32", tensor_parallel_size=2, max_model_len=64)
