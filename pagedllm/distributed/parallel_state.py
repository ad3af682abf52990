"""The tensor-parallel group of this process, and the collectives the sharded layers use.

This is the one piece of process-wide state in the package (as in vLLM and nano-vllm): a worker process
joins exactly one tensor-parallel group at start-up, and every sharded layer of its model talks through
it. The engine process never joins; with one rank nothing here is ever called, because layers built with
tp_size 1 skip their collectives (and a TP-1 draft model inside a TP-N worker skips them too).

Collectives go over torch.distributed: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_CPU_GROUP: dist.ProcessGroup | None = None  # gloo, for Python objects (the default group when on CPU)
_TP_RANK = 0
_TP_WORLD_SIZE = 1
# Bytes of the tensors this process has put through each collective, for benchmarks (bytes per token).
collective_bytes = {"all_reduce": 0, "all_gather": 0, "gather": 0}


@dataclass(frozen=True)
class WeightShard:
    """Which part of its checkpoint tensors a rank's projection holds: along `dim` (0: output features,
    column-parallel; 1: input features, row-parallel), `ranges[i]` = (start, length) of checkpoint tensor i
    (fused projections: one range per part, the parts concatenated along the output features)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]


def init_distributed_environment(rank: int, world_size: int, init_method: str, backend: str,
                                 timeout_s: float = 600.0) -> None:
    """Join the default group (TCP rendezvous at `init_method`, e.g. tcp://host:port); it is the TP group."""
    global _TP_GROUP, _CPU_GROUP, _TP_RANK, _TP_WORLD_SIZE
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _TP_GROUP = dist.group.WORLD
    _CPU_GROUP = _TP_GROUP if backend == "gloo" else dist.new_group(backend="gloo")
    _TP_RANK, _TP_WORLD_SIZE = rank, world_size


def destroy_distributed_environment() -> None:
    global _TP_GROUP, _CPU_GROUP, _TP_RANK, _TP_WORLD_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP, _CPU_GROUP, _TP_RANK, _TP_WORLD_SIZE = None, None, 0, 1


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_WORLD_SIZE


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place (a no-op with one rank)."""
    if _TP_WORLD_SIZE == 1:
        return tensor
    dist.all_reduce(tensor, group=_TP_GROUP)
    collective_bytes["all_reduce"] += tensor.numel() * tensor.element_size()
    return tensor


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's tensor concatenated along `dim` in rank order, on every rank."""
    if _TP_WORLD_SIZE == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(_TP_WORLD_SIZE)]
    dist.all_gather(parts, tensor.contiguous(), group=_TP_GROUP)
    collective_bytes["all_gather"] += tensor.numel() * tensor.element_size()
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank `src`'s Python object, on every rank (pickled, over gloo)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_CPU_GROUP)
    return box[0]


def broadcast_tensor(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s CPU tensor, in place of each rank's tensor of the same shape and dtype (over gloo)."""
    dist.broadcast(tensor, src=src, group=_CPU_GROUP)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's Python object, in rank order, on every rank."""
    out: list[Any] = [None] * _TP_WORLD_SIZE
    dist.all_gather_object(out, obj, group=_CPU_GROUP)
    return out


def tensor_model_parallel_gather(tensor: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Every rank's tensor concatenated along `dim` on rank `dst`; None on the other ranks."""
    if _TP_WORLD_SIZE == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_TP_WORLD_SIZE)] if _TP_RANK == dst else None
    dist.gather(tensor, parts, dst=dst, group=_TP_GROUP)
    collective_bytes["gather"] += tensor.numel() * tensor.element_size()
    return torch.cat(parts, dim=dim) if parts is not None else None
