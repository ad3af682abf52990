"""The batched LoRA delta around a projection (the Punica / S-LoRA formulation).

A wrapped projection holds its adapters' weights for all `max_loras` slots at once. For a projection
fused from P parts (q|k|v: 3, gate|up: 2, o and down: 1), with S slots of rank R:

    A  [P * S * R, in]     part-major, then slot, then rank
    B  [out, S * R]        the rows of part p (its output features) read only part p's S * R columns

and one step costs one shrink and P expands, whatever mix of adapters it holds:

    shrink  = x @ A^T                          [tokens, P * S * R]
    shrink *= mask                             each token keeps its own slot's columns (base tokens none)
    y[:, part p] += shrink[:, part p] @ B_p^T  B already carries each adapter's scaling

There is no per-adapter loop: a token's delta is its own adapter's exactly (the other slots' columns are
multiplied by zero), so batch composition never changes it. The matmuls use the kernel the base
projection uses (the blocked or oneDNN prepacked layout, or F.linear), on copies packed each time a slot
changes; the base path itself is untouched, and a step in which no token has an adapter skips the delta.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import BlockedLinear, packed_linear

Matmul = Callable[..., torch.Tensor]


class LoRAStepContext:
    """The per-step context every wrapped projection reads: each token's slot (-1: the base model), set by
    the model runner before the forward pass (LoRAManager.prepare_step), and the masks derived from it,
    built once per step for each (parts, rank) shape."""

    def __init__(self, num_slots: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.active = False
        self._slot_mask: torch.Tensor | None = None   # [tokens, slots * rank]
        self._masks: dict[int, torch.Tensor] = {}

    def set_token_slots(self, token_slots: torch.Tensor | None) -> None:
        self._masks = {}
        if token_slots is None or not bool((token_slots >= 0).any()):
            self.active, self._slot_mask = False, None
            return
        slots = torch.arange(self.num_slots, device=token_slots.device)
        one_hot = (token_slots[:, None] == slots[None, :]).to(self.dtype)
        self._slot_mask = one_hot.repeat_interleave(self.rank, dim=1)
        self.active = True

    def mask(self, num_parts: int) -> torch.Tensor:
        mask = self._masks.get(num_parts)
        if mask is None:
            assert self._slot_mask is not None
            mask = self._masks[num_parts] = self._slot_mask.repeat(1, num_parts) if num_parts > 1 else self._slot_mask
        return mask


def pack_like(base: Matmul, weight: torch.Tensor) -> tuple[torch.Tensor, Matmul]:
    """(weight in the layout `base` reads, the matmul that reads it): LoRA runs on the base's kernel."""
    weight = weight.contiguous()
    if isinstance(base, BlockedLinear):
        return torch.ops.pagedllm_cpu_linear.blocked_linear_pack(weight), BlockedLinear(weight.shape[0], base.amx)
    if base is packed_linear:
        return torch.ops.mkldnn._reorder_linear_weight(weight), packed_linear
    return weight, F.linear


class LoRAMatmul:
    """A projection module's `matmul` with the step's LoRA deltas added to its output."""

    def __init__(self, base: Matmul, a: torch.Tensor, b: torch.Tensor, part_sizes: list[int],
                 context: LoRAStepContext):
        self.base = base
        self.a = a                    # [P * S * R, in], filled by the LoRA manager
        self.b = b                    # [out, S * R]
        self.part_sizes = part_sizes  # each part's output features on this rank
        self.context = context
        self.repack()

    def repack(self) -> None:
        """Re-read the plain A and B into the kernel's layout (after the manager changed a slot)."""
        self.a_packed, self.a_matmul = pack_like(self.base, self.a)
        self.b_packed: list[tuple[torch.Tensor, Matmul]] = []
        offset = 0
        for size in self.part_sizes:
            self.b_packed.append(pack_like(self.base, self.b[offset:offset + size]))
            offset += size

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base(x, weight, bias)
        context = self.context
        if not context.active:
            return y
        num_parts = len(self.part_sizes)
        shrink = self.a_matmul(x, self.a_packed).mul_(context.mask(num_parts))
        if num_parts == 1:
            b, matmul = self.b_packed[0]
            return y.add_(matmul(shrink, b))
        # each part's columns as one contiguous block: one copy, not one per part
        by_part = shrink.view(shrink.shape[0], num_parts, -1).transpose(0, 1).contiguous()
        offset = 0
        for shrunk, size, (b, matmul) in zip(by_part, self.part_sizes, self.b_packed):
            y[:, offset:offset + size].add_(matmul(shrunk, b))
            offset += size
        return y
