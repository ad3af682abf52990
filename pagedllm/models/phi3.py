"""Phi-3 / Phi-4-mini: the Llama decoder with fused checkpoint projections and LongRoPE.

- The checkpoint stores q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj`: the same layouts as
  our fused parameters, so they load as row ranges of one tensor (and shard by rows under tensor
  parallelism, as separate tensors would).
- `partial_rotary_factor` (Phi-4-mini: 0.75): only the first part of each head rotates.
- LongRoPE (`longrope`, first named `su`): per-frequency rescale factors, a short set for contexts
  within original_max_position_embeddings and a long set beyond, the set chosen once per engine
  (LlamaForCausalLM.make_rotary: long when max_model_len exceeds the original length).
- `sliding_window`, when set, applies to every layer (ModelConfig.layer_sliding_window).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import WeightShard
from pagedllm.layers.linear import GetSlice, LoadLinear
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaForCausalLM


class _Rows:
    """A row range of a checkpoint slice that indexes like a slice of its own (a part of a fused tensor)."""

    def __init__(self, whole: Any, start: int, rows: int):
        self.whole, self.start, self.rows = whole, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *list(self.whole.get_shape())[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        begin, end, _ = rows.indices(self.rows)
        return self.whole[(slice(self.start + begin, self.start + end), *rest)]


class _Names:
    """The checkpoint's names (a set, or a GGUF file's) plus the parts of its fused tensors."""

    def __init__(self, names: Any, parts: dict[str, Any]):
        self.names, self.parts = names, parts

    def __contains__(self, name: str) -> bool:
        return name in self.parts or name in self.names


def phi3_rotary_dim(config: ModelConfig) -> int:
    hf = config.hf_config
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
    return int(config.head_dim * float(factor))


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_rotary(config: ModelConfig, rotary_dim: int | None = None) -> RotaryEmbedding:
        return LlamaForCausalLM.make_rotary(config, rotary_dim or phi3_rotary_dim(config))

    def load_weights(self, get_slice: GetSlice, names: set[str], load_linear: LoadLinear | None = None) -> None:
        config = self.config
        q_rows = config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        mlp_rows = config.intermediate_size
        # Each fused tensor seen as its parts, under the names the Llama loader reads.
        parts: dict[str, tuple[str, int, int]] = {}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv, gate_up = f"{p}self_attn.qkv_proj.weight", f"{p}mlp.gate_up_proj.weight"
            parts[f"{p}self_attn.q_proj.weight"] = (qkv, 0, q_rows)
            parts[f"{p}self_attn.k_proj.weight"] = (qkv, q_rows, kv_rows)
            parts[f"{p}self_attn.v_proj.weight"] = (qkv, q_rows + kv_rows, kv_rows)
            parts[f"{p}mlp.gate_proj.weight"] = (gate_up, 0, mlp_rows)
            parts[f"{p}mlp.up_proj.weight"] = (gate_up, mlp_rows, mlp_rows)

        def split_slice(name: str) -> Any:
            if name in parts:
                fused, start, rows = parts[name]
                return _Rows(get_slice(fused), start, rows)
            return get_slice(name)

        def fused_load_linear(param: torch.Tensor, srcs: tuple[str, ...], shard: WeightShard) -> bool:
            # A weight-only quantizer reads the fused tensor itself: each part's range moves by the part's
            # offset in it, and ranges that meet (all of them with one rank) become one.
            if load_linear is None:
                return False
            if not any(name in parts for name in srcs):
                return load_linear(param, srcs, shard)
            names: list[str] = []
            ranges: list[tuple[int, int]] = []
            for name, (start, length) in zip(srcs, shard.ranges):
                fused, part_start, _ = parts[name]
                start += part_start
                if names and names[-1] == fused and sum(ranges[-1]) == start:
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
                else:
                    names.append(fused)
                    ranges.append((start, length))
            return load_linear(param, tuple(names), WeightShard(shard.dim, tuple(ranges)))

        super().load_weights(split_slice, _Names(names, parts), fused_load_linear)
