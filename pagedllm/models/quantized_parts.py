"""A quantized weight in its logical form, before any kernel packs it: the step where tensor parallelism
takes each rank's shard.

`QuantizedParts` holds the integer values `q` [N, K] and their scales (per output channel [N], or per group
of input channels [N, K / G]) and, for int4, an offset per group, so that w = q * scale (+ offset). Every
source of quantized projections (a compressed-tensors checkpoint, a GGUF file's blocks, quantization on
load) is read into this form, a rank keeps its rows (column-parallel) or its whole groups of columns
(row-parallel) with `narrow`, and only then is the kernel's packed weight built (`build`): a packed layout
is never sliced, so it may change without touching sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.distributed.parallel_state import WeightShard


@dataclass
class QuantizedParts:
    """w = q * scale (+ offset), exactly as the source stores it. `kind`: "int8", "int4" or "fp8"."""

    kind: str
    q: torch.Tensor
    scale: torch.Tensor  # [N] per output channel, or [N, K / G] per group
    offset: torch.Tensor | None = None  # [N, K / G] (int4)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def group_size(self) -> int | None:
        return self.q.shape[1] // self.scale.shape[1] if self.scale.dim() == 2 else None

    @staticmethod
    def cat(parts: list[QuantizedParts]) -> QuantizedParts:
        """Fused projections: the parts' output rows one after another."""
        if len(parts) == 1:
            return parts[0]
        offsets = [p.offset for p in parts]
        return type(parts[0])(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                              None if offsets[0] is None else torch.cat(offsets))  # type: ignore[arg-type]

    def narrow(self, dim: int, start: int, length: int, name: str) -> QuantizedParts:
        """The part a tensor-parallel rank keeps: output rows with their scales (dim 0), or input columns
        with their groups' scales (dim 1; per-channel scales stay whole). ValueError naming the checkpoint
        tensor `name` when the columns would split a group: its scale could not be shared by two ranks."""
        if (start, length) == (0, self.q.shape[dim]):
            return self
        if dim == 0:
            return type(self)(self.kind, self.q[start:start + length], self.scale[start:start + length],
                              None if self.offset is None else self.offset[start:start + length])
        group = self.group_size
        if group is None:
            return type(self)(self.kind, self.q[:, start:start + length].contiguous(), self.scale, self.offset)
        if start % group or length % group:
            raise ValueError(f"tensor parallelism would split a quantization group of {name!r}: a rank holds its "
                             f"input features [{start}, {start + length}), which is not whole groups of {group}. "
                             f"Use a tensor_parallel_size (or quantization_group_size) that gives every rank a "
                             f"multiple of {group} input features.")
        groups = slice(start // group, (start + length) // group)
        return type(self)(self.kind, self.q[:, start:start + length].contiguous(),
                          self.scale[:, groups].contiguous(),
                          None if self.offset is None else self.offset[:, groups].contiguous())

    def build(self, method: Any, dtype: torch.dtype):
        """The kernel's weight, packed from this (rank's) logical weight. Scales of int8 are stored in the
        model dtype; int4 takes fp32 scales and offsets and rounds them once itself; fp8 keeps fp32."""
        from pagedllm.layers.quantization import QuantizedWeight

        if self.kind == "int4":
            assert self.offset is not None
            return method.create(self.q, self.scale, self.offset, dtype=dtype)
        scale = self.scale.to(dtype) if self.kind == "int8" else self.scale
        return QuantizedWeight(self.q.contiguous(), scale.contiguous(), method)


def shard_parts(parts: list[QuantizedParts], shard: WeightShard, names: tuple[str, ...]) -> QuantizedParts:
    """This rank's fused weight: each checkpoint tensor's range, then the parts concatenated."""
    assert len(parts) == len(shard.ranges) == len(names)
    return QuantizedParts.cat([p.narrow(shard.dim, start, length, name)
                               for p, (start, length), name in zip(parts, shard.ranges, names)])
