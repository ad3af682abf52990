"""Mixture-of-experts layer: a router picks top-k experts per token, experts run grouped by expert.

Routing functions follow the checkpoints that use them:
- softmax top-k (Mixtral always renormalizes the k weights; Qwen3-MoE when `norm_topk_prob`),
- DeepSeek-V2: softmax scores, `greedy` or `group_limited_greedy` (keep the `topk_group` groups with
  the best single expert, pick top-k inside them), times `routed_scaling_factor`,
- DeepSeek-V3 `noaux_tc`: sigmoid scores, top-k chosen on scores + `e_score_correction_bias` within
  the `topk_group` groups whose two best biased scores sum highest, weighted by the unbiased scores.

Expert computation sorts the (token, expert) pairs by expert and runs one gate_up and one down matmul
per expert that received tokens, so the work is E small GEMMs rather than T*k vector products.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.module import Module

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    renormalize: bool = False
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_fp32: bool = False           # DeepSeek keeps the gate (and its logits) in float32
    num_shared_experts: int = 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any], model_type: str) -> MoEConfig:
        """Read and validate the routing fields; a value we cannot serve is a ValueError naming it."""
        num_experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts") or 0)
        top_k = int(hf.get("num_experts_per_tok") or 0)
        if num_experts <= 0:
            raise ValueError(f"{model_type}: the number of routed experts must be positive, got {num_experts}.")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}.")
        if model_type == "mixtral":
            return cls(num_experts, top_k, int(hf["intermediate_size"]), renormalize=True)
        if model_type == "qwen3_moe":
            return cls(num_experts, top_k, int(hf["moe_intermediate_size"]),
                       renormalize=bool(hf.get("norm_topk_prob", False)))
        if model_type not in ("deepseek_v2", "deepseek_v3"):
            raise ValueError(f"model_type {model_type!r} has no MoE routing here.")
        v3 = model_type == "deepseek_v3"
        scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring!r}.")
        if method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {method!r}.")
        # The pairs the published checkpoints (and transformers) implement; others would route silently wrong.
        if v3 and (method, scoring) != ("noaux_tc", "sigmoid"):
            raise ValueError(f"deepseek_v3 routes with topk_method='noaux_tc' and scoring_func='sigmoid'; "
                             f"got topk_method={method!r}, scoring_func={scoring!r}.")
        if not v3 and (method == "noaux_tc" or scoring != "softmax"):
            raise ValueError(f"deepseek_v2 routes with scoring_func='softmax' and topk_method 'greedy' or "
                             f"'group_limited_greedy'; got topk_method={method!r}, scoring_func={scoring!r}.")
        if not v3 and hf.get("norm_topk_prob"):
            # DeepSeek's reference code renormalizes here and transformers does not: no answer is right.
            raise ValueError("norm_topk_prob=True is not supported for deepseek_v2 (the reference code and "
                             "transformers disagree on it); published DeepSeek-V2 checkpoints set it false.")
        n_group = int(hf.get("n_group") or 1)
        topk_group = int(hf.get("topk_group") or 1)
        if method != "greedy":
            if num_experts % n_group:
                raise ValueError(f"n_group={n_group} must divide the {num_experts} routed experts.")
            if not 0 < topk_group <= n_group:
                raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}.")
            if topk_group * (num_experts // n_group) < top_k:
                raise ValueError(f"topk_group={topk_group} groups of {num_experts // n_group} experts cannot "
                                 f"supply num_experts_per_tok={top_k}.")
        if method == "noaux_tc" and num_experts // n_group < 2:
            raise ValueError(f"noaux_tc scores a group by its two best experts; n_group={n_group} leaves "
                             f"{num_experts // n_group} per group.")
        return cls(num_experts, top_k, int(hf["moe_intermediate_size"]), scoring_func=scoring,
                   topk_method=method, renormalize=bool(hf.get("norm_topk_prob", False)) and v3,
                   num_expert_group=n_group, topk_group=topk_group,
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), router_fp32=True,
                   num_shared_experts=int(hf.get("n_shared_experts") or 0))


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool mask of the experts inside each token's best groups."""
    num_groups = group_scores.shape[-1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    return group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts).bool()


def select_experts(router_logits: torch.Tensor, cfg: MoEConfig, e_score_correction_bias: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k])."""
    num_experts = cfg.num_experts
    if cfg.scoring_func == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if cfg.topk_method == "noaux_tc":
        biased = scores + e_score_correction_bias if e_score_correction_bias is not None else scores
        group_scores = biased.view(-1, cfg.num_expert_group, num_experts // cfg.num_expert_group
                                   ).topk(2, dim=-1)[0].sum(dim=-1)
        mask = _group_mask(group_scores, cfg.topk_group, num_experts)
        topk_ids = torch.topk(biased.masked_fill(~mask, float("-inf")), k=cfg.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
        if cfg.renormalize:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, cfg.num_expert_group, num_experts // cfg.num_expert_group).max(dim=-1).values
        mask = _group_mask(group_scores, cfg.topk_group, num_experts)
        topk_weights, topk_ids = torch.topk(scores.masked_fill(~mask, 0.0), k=cfg.top_k, dim=-1, sorted=False)
    else:
        topk_weights, topk_ids = torch.topk(scores, k=cfg.top_k, dim=-1)
        if cfg.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if cfg.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * cfg.routed_scaling_factor
    return topk_weights, topk_ids


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]. Returns [T, H].

    The T*k (token, expert) pairs are sorted by expert (stable, so each expert sees its tokens in
    order), each expert with tokens runs two matmuls over its rows, and the weighted rows are summed
    back into their tokens.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows_in = hidden.index_select(0, token_of_row)
    rows_out = torch.empty_like(rows_in)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        rows_out[rows] = F.linear(act_and_mul(F.linear(rows_in[rows], w13[expert])), w2[expert])
        start += count
    rows_out *= topk_weights.reshape(-1)[order].to(rows_out.dtype).unsqueeze(1)
    return torch.zeros_like(hidden).index_add_(0, token_of_row, rows_out)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class FusedMoE(Module):
    """Router + routed experts (+ DeepSeek's shared experts, a dense MLP every token passes through).

    `hf_prefix` is the checkpoint's name for this block relative to the layer ("mlp." or Mixtral's
    "block_sparse_moe."); `load_weights` accepts per-expert tensors (what save_pretrained writes, and
    published checkpoints use) or transformers' fused 3-D `experts.gate_up_proj` / `experts.down_proj`.
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int, hidden_act: str, dtype: torch.dtype,
                 hf_prefix: str = "mlp.", use_correction_bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.hf_prefix = hf_prefix
        e, i = cfg.num_experts, cfg.intermediate_size
        self.gate_weight = _param(e, hidden_size, dtype=torch.float32 if cfg.router_fp32 else dtype)
        self.e_score_correction_bias = _param(e, dtype=torch.float32) if use_correction_bias else None
        self.w13 = _param(e, 2 * i, hidden_size, dtype=dtype)
        self.w2 = _param(e, hidden_size, i, dtype=dtype)
        self.act_and_mul = get_act_and_mul(hidden_act)
        if cfg.num_shared_experts:
            shared = i * cfg.num_shared_experts
            self.shared_gate_up = _param(2 * shared, hidden_size, dtype=dtype)
            self.shared_down = _param(hidden_size, shared, dtype=dtype)
        else:
            self.shared_gate_up = self.shared_down = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cfg.router_fp32:
            router_logits = F.linear(hidden.float(), self.gate_weight)
        else:
            router_logits = F.linear(hidden, self.gate_weight)
        topk_weights, topk_ids = select_experts(router_logits, self.cfg, self.e_score_correction_bias)
        out = fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids, self.act_and_mul)
        if self.shared_gate_up is not None:
            out = out + F.linear(self.act_and_mul(F.linear(hidden, self.shared_gate_up)), self.shared_down)
        return out

    def load_weights(self, get_tensor: Callable[[str], torch.Tensor], names: set[str], layer_prefix: str) -> None:
        p = layer_prefix + self.hf_prefix
        self.gate_weight.copy_(get_tensor(f"{p}gate.weight"))
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.copy_(get_tensor(f"{p}gate.e_score_correction_bias"))
        if f"{p}experts.gate_up_proj" in names:  # transformers 5's fused layout: [E, 2I, H] and [E, H, I]
            self.w13.copy_(get_tensor(f"{p}experts.gate_up_proj"))
            self.w2.copy_(get_tensor(f"{p}experts.down_proj"))
        else:
            # Mixtral names the expert matmuls w1 (gate), w3 (up), w2 (down).
            gate, up, down = (("w1", "w3", "w2") if f"{p}experts.0.w1.weight" in names
                              else ("gate_proj", "up_proj", "down_proj"))
            i = self.cfg.intermediate_size
            for e in range(self.cfg.num_experts):
                q = f"{p}experts.{e}."
                self.w13[e, :i].copy_(get_tensor(f"{q}{gate}.weight"))
                self.w13[e, i:].copy_(get_tensor(f"{q}{up}.weight"))
                self.w2[e].copy_(get_tensor(f"{q}{down}.weight"))
        if self.shared_gate_up is not None:
            q = f"{p}shared_experts."
            self.shared_gate_up.copy_(torch.cat([get_tensor(f"{q}gate_proj.weight"),
                                                 get_tensor(f"{q}up_proj.weight")], dim=0))
            self.shared_down.copy_(get_tensor(f"{q}down_proj.weight"))
