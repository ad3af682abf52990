"""The batched LoRA delta around a projection (the Punica / S-LoRA formulation).

Every wrapped projection holds its adapters' weights for all `max_loras` slots in one pair of tensors:
A_flat [slots * width, in] and B_flat [out, slots * width], where width = parts * max_lora_rank (a fused
projection such as q|k|v has one rank block per part, and B is block-diagonal over the parts). One step
then costs two matmuls per projection whatever mix of adapters it holds:

    shrink  = x @ A_flat^T                   [tokens, slots * width]
    shrink *= mask                           each token keeps only its own slot's block (base tokens none)
    y      += shrink @ B_flat^T              B already carries each adapter's scaling

There is no per-adapter loop: a token's delta is its own adapter's exactly (the other slots' columns are
multiplied by zero), so batch composition never changes it. The base path (`base`, the projection's
F.linear or prepacked kernel) is untouched, and a step in which no token has an adapter skips the delta.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class LoRAStepContext:
    """The per-step context every wrapped projection reads: each token's slot (-1: the base model), set by
    the model runner before the forward pass (LoRAManager.prepare_step), and the masks derived from it,
    built once per step for each block width."""

    def __init__(self, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = device
        self.active = False
        self._one_hot: torch.Tensor | None = None   # [tokens, slots]
        self._masks: dict[int, torch.Tensor] = {}

    def set_token_slots(self, token_slots: torch.Tensor | None) -> None:
        self._masks = {}
        if token_slots is None or not bool((token_slots >= 0).any()):
            self.active, self._one_hot = False, None
            return
        slots = torch.arange(self.num_slots, device=token_slots.device)
        self._one_hot = (token_slots[:, None] == slots[None, :]).to(self.dtype)
        self.active = True

    def mask(self, width: int) -> torch.Tensor:
        mask = self._masks.get(width)
        if mask is None:
            assert self._one_hot is not None
            mask = self._masks[width] = self._one_hot.repeat_interleave(width, dim=1)
        return mask


class LoRAMatmul:
    """A projection module's `matmul` with the step's LoRA deltas added to its output."""

    def __init__(self, base: Callable[..., torch.Tensor], a_flat: torch.Tensor, b_flat: torch.Tensor,
                 context: LoRAStepContext):
        self.base = base
        self.a_flat = a_flat
        self.b_flat = b_flat
        self.width = a_flat.shape[0] // context.num_slots
        self.context = context

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base(x, weight, bias)
        context = self.context
        if not context.active:
            return y
        shrink = F.linear(x, self.a_flat).mul_(context.mask(self.width))
        return y + F.linear(shrink, self.b_flat)
