"""Megatron-style tensor-parallel layers: each rank holds a slice of a weight and reads only that slice.

- ColumnParallelLinear splits the output features: y_r = x A_r^T needs no communication. Several
  checkpoint tensors can be fused along the output dimension (q|k|v, gate|up); each rank keeps its slice
  of every part, so after the fused matmul a rank holds its own heads / its own intermediate features.
- RowParallelLinear splits the input features: each rank computes a partial sum x_r A_r^T, and one
  all-reduce adds them up (o_proj after attention, down_proj after the MLP: two all-reduces per layer).
- VocabParallelEmbedding splits the vocabulary: a rank looks up the ids in its range, zeroes the others,
  and an all-reduce assembles the rows. ParallelLMHead uses the same split for the output projection:
  each rank computes the logits of its vocabulary range and rank 0 gathers them once per step.

With tp_size 1 every layer is a plain F.linear / F.embedding on the whole weight: no extra copy and no
collective.

Weights come from `get_slice(name)`, a safetensors slice: indexing it reads only the requested rows or
columns from the file, so no rank ever materializes a whole sharded tensor.

On CPU, `prepack_linear_weights` then puts every full-precision projection weight once in a layout a
fast kernel reads (pagedllm's blocked kernel, or oneDNN's; see there), and the layers call that kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.distributed.parallel_state import (
    WeightShard,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from pagedllm.layers.linear_tuning import BUCKET_WEIGHTS, LM_HEAD_BUCKET_WEIGHTS, choose_linear_kernel
from pagedllm.layers.module import Module
from pagedllm.layers.quantization import linear
from pagedllm.layers.sampler import argmax_rows
from pagedllm.platform import HugePageArena, release_free_heap_memory

logger = logging.getLogger(__name__)

GetSlice = Callable[[str], Any]  # name -> a safetensors slice (supports get_shape() and [a:b] / [:, a:b])
# (param, checkpoint names, the part of them this rank holds) -> True if it installed a weight-only
# quantized projection (this rank's shard of it) in param's place
LoadLinear = Callable[[torch.Tensor, tuple[str, ...], WeightShard], bool]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator}).")
    return numerator // denominator


class ColumnParallelLinear(Module):
    """Output features split across ranks. Part i of the fused weight is rows
    [shard_indices[i] * shard_sizes[i], (shard_indices[i] + 1) * shard_sizes[i]) of checkpoint tensor i."""

    def __init__(self, input_size: int, shard_sizes: list[int], shard_indices: list[int], bias: bool,
                 dtype: torch.dtype):
        super().__init__()
        self.shard_sizes = shard_sizes
        self.shard_indices = shard_indices
        self.weight = _param(sum(shard_sizes), input_size, dtype=dtype)
        self.bias = _param(sum(shard_sizes), dtype=dtype) if bias else None
        self.matmul: Callable[..., torch.Tensor] = linear  # packed_linear once the weight is prepacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)  # F.linear, prepacked, or weight-only quantized

    def load(self, get_slice: GetSlice, weight_names: list[str], bias_names: list[str] | None = None,
             load_linear: LoadLinear | None = None) -> None:
        shard = WeightShard(0, tuple((index * size, size) for size, index in zip(self.shard_sizes, self.shard_indices)))
        quantized = load_linear is not None and load_linear(self.weight, tuple(weight_names), shard)
        for param, names in ((self.weight, weight_names), (self.bias, bias_names)):
            if param is None or (quantized and param is self.weight):
                continue
            offset = 0
            for name, size, index in zip(names, self.shard_sizes, self.shard_indices):
                param[offset:offset + size].copy_(get_slice(name)[index * size:(index + 1) * size])
                offset += size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate|up: each part split evenly, rank r keeping the r-th slice of each."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1):
        sizes = [divide(size, tp_size, "intermediate_size") for size in output_sizes]
        super().__init__(input_size, sizes, [tp_rank] * len(sizes), bias, dtype)


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v with the heads split across ranks. When there are fewer KV heads than ranks, each KV head is
    replicated on tp_size / num_kv_heads consecutive ranks (as vLLM does), so a rank always holds whole
    heads and the query heads it holds attend to the KV head they share in the unsharded model."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1):
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads, replicas = kv_heads_per_rank(total_num_kv_heads, tp_size)
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        kv_index = tp_rank // replicas
        super().__init__(hidden_size, [q_size, kv_size, kv_size], [tp_rank, kv_index, kv_index], bias, dtype)


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(KV heads each rank holds, how many ranks hold each KV head)."""
    if total_num_kv_heads >= tp_size:
        return divide(total_num_kv_heads, tp_size, "num_key_value_heads"), 1
    if tp_size % total_num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads "
                         f"({total_num_kv_heads}) when it exceeds it, so each rank holds one whole KV head.")
    return 1, tp_size // total_num_kv_heads


class RowParallelLinear(Module):
    """Input features split across ranks; one all-reduce sums the partial products."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_rank = divide(input_size, tp_size, "input features of a row-parallel layer")
        self.weight = _param(output_size, self.input_size_per_rank, dtype=dtype)
        self.bias = _param(output_size, dtype=dtype) if bias else None
        self.matmul: Callable[..., torch.Tensor] = linear  # packed_linear once the weight is prepacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.weight, self.bias)  # F.linear, prepacked, or weight-only quantized
        out = tensor_model_parallel_all_reduce(self.matmul(x, self.weight))
        return out if self.bias is None else out + self.bias  # added once, after the sum

    def load(self, get_slice: GetSlice, weight_name: str, bias_name: str | None = None,
             load_linear: LoadLinear | None = None) -> None:
        n = self.input_size_per_rank
        shard = WeightShard(1, ((self.tp_rank * n, n),))
        if load_linear is None or not load_linear(self.weight, (weight_name,), shard):
            self.weight.copy_(get_slice(weight_name)[:, self.tp_rank * n:(self.tp_rank + 1) * n])
        if self.bias is not None and bias_name is not None:
            self.bias.copy_(get_slice(bias_name)[:])


class VocabParallelEmbedding(Module):
    """Rows of the vocabulary split into tp_size ranges of ceil(vocab / tp_size); the last is zero-padded.

    A checkpoint slice that offers `quantized_rows(start, stop)` (a GGUF block-quantized table) is kept as
    stored: `quantized_rows` then answers each lookup with the rows asked for, dequantized to fp32, and
    `weight` is dropped (a tied LM head keeps its own dense weight, loaded by the model)."""

    keeps_quantized_rows = True  # ParallelLMHead: no, it multiplies by the whole table
    LOAD_CHUNK_ROWS = 4096  # rows read at a time: a block-quantized table is never dequantized whole

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self.dtype = dtype
        self.num_embeddings_per_rank = -(-vocab_size // tp_size)
        self.vocab_start = min(tp_rank * self.num_embeddings_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, vocab_size)
        self.weight = _param(self.num_embeddings_per_rank, hidden_size, dtype=dtype)
        self.quantized_rows: nn.Module | None = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_rows is not None:
            return self.quantized_rows(ids).to(self.dtype).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = self._lookup(local_ids).masked_fill(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(out)

    def load(self, get_slice: GetSlice, name: str) -> None:
        src = get_slice(name)
        quantized_rows = getattr(src, "quantized_rows", None) if self.keeps_quantized_rows else None
        if quantized_rows is not None:
            self.quantized_rows = quantized_rows(self.vocab_start, self.vocab_end)
            if self.quantized_rows is not None:
                self.weight = None  # never written, so never resident; a tied LM head holds its own reference
                return
        rows = self.vocab_end - self.vocab_start
        if rows < self.num_embeddings_per_rank:
            self.weight[rows:].zero_()
        for start in range(0, rows, self.LOAD_CHUNK_ROWS):
            stop = min(start + self.LOAD_CHUNK_ROWS, rows)
            self.weight[start:stop].copy_(src[self.vocab_start + start:self.vocab_start + stop])


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection with the embedding's vocabulary split (and, when tied, its very weight)."""

    keeps_quantized_rows = False

    # The weight in a packed layout and the matmul that reads it (prepack_linear_weights); `weight` is
    # kept beside it only while a tied embedding reads it as rows.
    packed_weight: torch.Tensor | None = None
    packed_matmul: Callable[..., torch.Tensor] | None = None

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(vocab_size, hidden_size, dtype, tp_rank, tp_size)
        # A quantized weight (a QuantizedWeight module) in place of `weight`: a tied GGUF table multiplied
        # as stored (use_quantized_table)
        self.quantized_weight: nn.Module | None = None

    def use_quantized_table(self, embedding: VocabParallelEmbedding, dtype: torch.dtype) -> bool:
        """Tied to an embedding kept in a GGUF block type: multiply by that table as stored, where a
        quantized kernel takes it, and let the embedding read its rows from this one copy. False (nothing
        changed) where none does; the LM head then loads its own dense weight."""
        rows = embedding.quantized_rows
        as_weight = getattr(rows, "as_weight", None)
        if as_weight is None or self.vocab_end - self.vocab_start != self.num_embeddings_per_rank:
            return False  # (a padded last shard would need padded packed rows)
        weight = as_weight(dtype)
        if weight is None:
            return False
        from pagedllm.layers.quantization.vnni import VnniRows

        self.quantized_weight, self.weight = weight, None
        embedding.quantized_rows = VnniRows(weight)
        return True

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """float32 logits [N, vocab] on rank 0 (gathered once); None on the other ranks. upcast=False
        leaves them in the dtype the matmul made, for a caller that only takes each row's argmax (the
        same index: the cast to float32 is exact and keeps the order)."""
        if self.quantized_weight is not None:
            logits = self.quantized_weight.apply(hidden, None)
        elif self.packed_matmul is not None:
            logits = self.packed_matmul(hidden, self.packed_weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_gather(logits, dim=-1)
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
        return logits.float() if upcast else logits

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of compute_logits(hidden, upcast=False): a plain-greedy step's tokens (None off
        rank 0). With the weight in the blocked bf16 layout, in one pass that never stores the logits
        (blocked_linear_argmax: the same index, from the same rounded values)."""
        matmul = self.packed_matmul
        if self.tp_size == 1 and isinstance(matmul, BlockedLinear) and hidden.dtype == torch.bfloat16:
            return torch.ops.pagedllm_cpu_linear.blocked_linear_argmax(hidden, self.packed_weight,
                                                                       matmul.out_features, matmul.amx)
        logits = self.compute_logits(hidden, upcast=False)
        return argmax_rows(logits) if logits is not None else None


# ---- prepacked CPU weights ----
# Every full-precision projection is put once, at load, in a layout a fast CPU kernel reads; F.linear on the
# plain [out, in] tensor makes oneDNN reorder bf16 weights on every call, or (fp32) runs the BLAS. Two
# layouts, chosen per dtype from what this CPU's build of the C++ ops supports:
#
# - "blocked" (pagedllm's own kernel, layers/csrc/cpu_linear.cpp; fp32 with AVX-512 or AVX2 + FMA, bf16
#   with AVX512-BF16): 64 (AVX2: 16) output features at a time stored k-major, so a batch-1 decode step
#   reads each weight as one sequential stream. "amx" is the same layout read by AMX tiles (bf16).
# - "onednn" (`torch.ops.mkldnn._reorder_linear_weight`): bf16 bit-identical to F.linear; on CPUs with
#   AMX it uses the matrix tiles.
# Which is faster depends on the CPU (3x either way at batch 16), so it is measured on this CPU, on the
# model's own shapes, and cached (layers/linear_tuning.py); PAGEDLLM_CPU_PREPACK_WEIGHTS=blocked|onednn|0
# forces one, and `pagedllm bench prepack` runs each in turn on one model.
#
# Both compute a row the same way whatever else is in the batch; F.linear does not (the BLAS takes another
# path for one or two rows, about 1e-5 apart), so a model whose logits reach the outputs stays packed. A
# draft model's numerics never reach them (its proposals are verified by the target); with oneDNN, small
# fp32 weights stay plain there, since oneDNN's per-call cost exceeds F.linear's on shapes under 1 MiB.
PREPACK_ENV = "PAGEDLLM_CPU_PREPACK_WEIGHTS"  # 0: plain F.linear; amx / blocked / onednn: that one; else measured
PREPACK_DTYPES = (torch.float32, torch.bfloat16)
PLAIN_FP32_MAX_NUMEL = 1 << 18  # 1 MiB of fp32


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias, `weight` reordered by `torch.ops.mkldnn._reorder_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class BlockedLinear:
    """The matmul of a weight packed by `torch.ops.pagedllm_cpu_linear.blocked_linear_pack` (a module's
    `matmul`); it keeps the output size, which the flat packed tensor does not carry, and whether the
    kernel runs on AMX tiles (the "amx" path)."""

    def __init__(self, out_features: int, amx: bool = False):
        self.out_features = out_features
        self.amx = amx

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.pagedllm_cpu_linear.blocked_linear(x, weight, self.out_features, bias, self.amx)


def is_prepacked(matmul: Callable[..., torch.Tensor] | None) -> bool:
    """Whether a module's matmul runs on a prepacked weight (either layout)."""
    return matmul is packed_linear or isinstance(matmul, BlockedLinear)


def prepack_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU, fp32 or bf16, oneDNN built in, and not turned off by PAGEDLLM_CPU_PREPACK_WEIGHTS=0."""
    return (device.type == "cpu" and dtype in PREPACK_DTYPES and torch.backends.mkldnn.is_available()
            and str(envs.value(PREPACK_ENV)).strip().lower() not in ("0", "plain"))


def blocked_layout_available(dtype: torch.dtype) -> bool:
    """pagedllm's blocked kernel runs this dtype on this CPU (its C++ ops built; fp32 needs AVX2 + FMA or
    AVX-512, bf16 AVX512-BF16), and PAGEDLLM_CPU_PREPACK_WEIGHTS does not ask for another path. (With
    the default, the measured table may still choose oneDNN; PAGEDLLM_CPU_TUNE=0 keeps the blocked layout.)"""
    from pagedllm.cpu_kernels import load_cpu_kernels

    return (str(envs.value(PREPACK_ENV)).strip().lower() not in ("onednn", "0", "plain") and load_cpu_kernels()
            and bool(torch.ops.pagedllm_cpu_linear.blocked_linear_supports(dtype)))


class _PackedArena:
    """All of a model's blocked weights in one HugePageArena, packed straight into it in the order the
    forward pass reads them."""

    def __init__(self, weights: list[torch.Tensor]):
        self.arena = HugePageArena(self._nbytes(w) for w in weights)

    @staticmethod
    def _nbytes(weight: torch.Tensor) -> int:
        """The packed weight's size, by the kernel's own rule."""
        return torch.ops.pagedllm_cpu_linear.blocked_linear_packed_numel(weight) * weight.element_size()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` packed straight into the next slice of the arena."""
        out = self.arena.take(self._nbytes(weight)).view(weight.dtype)
        return torch.ops.pagedllm_cpu_linear.blocked_linear_pack(weight, out)


def _pack(weight: torch.Tensor, arena: _PackedArena | None, amx: bool = False
          ) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
    """(the weight in the blocked layout, in `arena`, or in oneDNN's without one; the matmul that reads it,
    on AMX tiles if `amx`)."""
    weight = weight.detach().contiguous()
    if arena is not None:
        return arena.pack(weight), BlockedLinear(weight.shape[0], amx)
    return torch.ops.mkldnn._reorder_linear_weight(weight), packed_linear


def prepack_linear_weights(model: nn.Module, device: torch.device, dtype: torch.dtype,
                           batch_invariant: bool = True) -> int:
    """Put every full-precision Column/RowParallelLinear weight (and the LM head) in the blocked or
    oneDNN layout in place; weight-only quantized projections keep their own kernels. Returns how many
    weights were packed (0 when prepack_enabled says no, or oneDNN refuses the first one).

    batch_invariant=False (a draft model): with oneDNN, fp32 weights of at most PLAIN_FP32_MAX_NUMEL
    elements stay plain for F.linear, which is faster there but not batch-invariant (see above); the
    blocked kernel is both, so it takes every weight."""
    if not prepack_enabled(device, dtype):
        return 0
    candidates: list[nn.Module] = []  # in the order the forward pass reads them
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            weight = module.weight
            if not isinstance(weight, torch.Tensor) or weight.dtype != dtype or is_prepacked(module.matmul):
                continue  # a QuantizedWeight, or already packed (a module reached twice)
            candidates.append(module)
        elif (isinstance(module, ParallelLMHead) and module.packed_weight is None and module.weight is not None
              and module.weight.dtype == dtype):
            candidates.append(module)
    if not candidates:
        return 0
    lm_head_only = all(isinstance(module, ParallelLMHead) for module in candidates)
    choice = choose_linear_kernel([tuple(module.weight.shape) for module in candidates], dtype, batch_invariant,
                                  LM_HEAD_BUCKET_WEIGHTS if lm_head_only else BUCKET_WEIGHTS)
    model.linear_kernel_choice = choice  # what the benchmarks print
    logger.info("Linear kernel: %s", choice.describe())
    if choice.path == "plain":
        return 0
    blocked, amx = choice.path in ("blocked", "amx"), choice.path == "amx"

    def keep_plain(weight: torch.Tensor) -> bool:
        return (not blocked and not batch_invariant and dtype == torch.float32
                and weight.numel() <= PLAIN_FP32_MAX_NUMEL)

    targets = [module for module in candidates if not keep_plain(module.weight)]
    num_plain = len(candidates) - len(targets)
    if not targets:
        return 0
    arena = _PackedArena([module.weight for module in targets]) if blocked else None
    extra_bytes = freed_bytes = 0
    try:
        for module in targets:
            if isinstance(module, ParallelLMHead):
                # A copy: a tied embedding reads `weight` by rows, which a packed layout cannot serve.
                module.packed_weight, module.packed_matmul = _pack(module.weight, arena, amx)
                extra_bytes += module.weight.numel() * module.weight.element_size()
            else:
                packed, module.matmul = _pack(module.weight, arena, amx)
                freed_bytes += module.weight.numel() * module.weight.element_size()
                module.weight = nn.Parameter(packed, requires_grad=False)
            if arena is not None and freed_bytes >= 256 << 20:
                # The arena is outside the heap, so the plain weights it replaces are never reused there:
                # return them as we go, so the process holds about one copy of the weights, not two.
                release_free_heap_memory()
                freed_bytes = 0
    except RuntimeError as error:  # a oneDNN build without this op or dtype: the plain path is correct
        logger.warning("Prepacking linear weights for oneDNN failed (%s); using F.linear.", error)
        _unpack(model)
        return 0
    # The packed LM head is all the logits read; its plain weight stays only for an embedding that reads
    # the same tensor by rows (tied, and not kept in the file's quantized type).
    rows_read = {id(module.weight) for module in model.modules()
                 if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
                 and module.weight is not None}
    for module in targets:
        if isinstance(module, ParallelLMHead) and id(module.weight) not in rows_read:
            extra_bytes -= module.weight.numel() * module.weight.element_size()
            module.weight = None
    if arena is not None:
        release_free_heap_memory()
    logger.info("Prepacked %d linear weights (%s, %s layout)%s%s; %s=0 turns it off, =amx / =blocked / =onednn "
                "force a path",
                len(targets), str(dtype).removeprefix("torch."),
                "blocked, AMX tiles" if amx else "blocked" if blocked else "oneDNN",
                f", plus a {extra_bytes / 2**20:.1f} MiB LM head copy" if extra_bytes > 0 else "",
                f"; {num_plain} small ones stay plain (not batch-invariant: a draft)" if num_plain else "",
                PREPACK_ENV)
    return len(targets)


def _unpack(model: nn.Module) -> None:
    """Back to plain weights after a oneDNN failure midway (to_dense undoes the reorder)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.matmul is packed_linear:
            module.weight = nn.Parameter(module.weight.to_dense(), requires_grad=False)
            module.matmul = linear
        elif isinstance(module, ParallelLMHead):
            module.packed_weight = module.packed_matmul = None
