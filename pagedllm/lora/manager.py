"""LoRAManager (a model runner's, one per tensor-parallel rank): adapters in CPU memory, slots on the device.

- The CPU cache: up to max_cpu_loras adapters read and checked (peft.load_adapter), least recently used
  evicted first. The engine core adds an adapter here when a request naming it arrives (add_lora), so
  reading it from disk is off the step's critical path; a step reads it again only if it was evicted since.
- The slots: max_loras adapters in the wrapped projections' stacked weights. A step's adapters are put in
  slots (the scheduler never runs more distinct adapters than slots), evicting slots no request of the
  step uses, least recently used first; filling a slot is one copy per projection.

Under tensor parallelism each rank keeps its part, as the layer the adapter belongs to is split: a
column-parallel projection (q|k|v, gate|up) keeps all of A and its own rows of B; a row-parallel one
(o, down) its own columns of A and all of B, its partial delta summed by the layer's all-reduce.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LoRAMatmul, LoRAStepContext
from pagedllm.lora.peft import LoRAModel, load_adapter, projection_shapes
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# our fused projection -> the Hugging Face modules it holds, in its order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class _Target:
    layer: int
    name: str         # our fused projection's name, which is also a fused checkpoint's (Phi-3)
    module: ColumnParallelLinear | RowParallelLinear
    parts: tuple[str, ...]
    full_sizes: list[int]  # each part's unsharded output features
    a: torch.Tensor   # [parts, slots, rank, in]
    b: torch.Tensor   # [out, slots, rank]
    matmul: LoRAMatmul


def _projections(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    found = []
    for index, layer in enumerate(getattr(model, "layers", [])):
        for owner in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
            for name in FUSED_PARTS:
                module = getattr(owner, name, None)
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    found.append((index, name, module))
    return found


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, lora_config: LoRAConfig,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1):
        self.model_config = model_config
        self.lora_config = lora_config
        self.device = device
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.dtype = lora_config.lora_dtype or model_config.dtype
        num_slots, rank = lora_config.max_loras, lora_config.max_lora_rank
        self.context = LoRAStepContext(num_slots, rank, self.dtype, device)
        self.targets: list[_Target] = []
        projections = _projections(model)
        if not projections:
            raise ValueError(f"enable_lora: the {model_config.architecture} model has no q/k/v/o or gate/up/down "
                             "projections that adapters can target.")
        for layer, name, module in projections:
            if not isinstance(module.weight, torch.Tensor) or module.weight.dtype not in (torch.float32,
                                                                                           torch.bfloat16,
                                                                                           torch.float16):
                raise ValueError("enable_lora cannot be combined with quantization: adapters apply to "
                                 "full-precision projections only.")
            parts = FUSED_PARTS[name]
            if isinstance(module, RowParallelLinear):  # o_proj, down_proj: back into the residual stream
                in_features, part_sizes = module.input_size_per_rank, [model_config.hidden_size]
            else:
                in_features, part_sizes = model_config.hidden_size, list(module.shard_sizes)
            a = torch.zeros(len(parts), num_slots, rank, in_features, dtype=self.dtype, device=device)
            b = torch.zeros(sum(part_sizes), num_slots, rank, dtype=self.dtype, device=device)
            matmul = LoRAMatmul(module.matmul, a.view(-1, in_features), b.view(sum(part_sizes), -1), part_sizes,
                                self.context)
            module.matmul = matmul
            full_sizes = [projection_shapes(model_config)[part][0] for part in parts]
            self.targets.append(_Target(layer, name, module, parts, full_sizes, a, b, matmul))
        # (layer, Hugging Face module) pairs an adapter may hold weights for
        self._wrapped = {(t.layer, part) for t in self.targets for part in (*t.parts, t.name)}
        self.cpu_loras: OrderedDict[int, LoRAModel] = OrderedDict()   # LRU: least recent first
        self.slot_of: OrderedDict[int, int] = OrderedDict()           # lora_int_id -> slot, LRU order
        self.requests: dict[int, LoRARequest] = {}
        self._last_key: tuple | None = None

    def slot_bytes(self) -> int:
        return sum(t.a.numel() * t.a.element_size() + t.b.numel() * t.b.element_size() for t in self.targets)

    # ---- the CPU cache ----
    def add_lora(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check the adapter into the CPU cache (a no-op when it is there); ValueError if bad."""
        lora_id = lora_request.lora_int_id
        known = self.requests.get(lora_id)
        if known is not None and known.lora_path != lora_request.lora_path:
            raise ValueError(f"lora_int_id {lora_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; give {lora_request.lora_name!r} another id.")
        model = self.cpu_loras.get(lora_id)
        if model is not None:
            self.cpu_loras.move_to_end(lora_id)
            return model
        model = load_adapter(lora_id, lora_request.lora_name, lora_request.lora_path, self.lora_config,
                             self.model_config, self.dtype)
        missing = sorted({module for layer, module in model.weights if (layer, module) not in self._wrapped})
        if missing:  # e.g. an MLP adapter on a mixture-of-experts model, whose experts have no such projection
            raise ValueError(f"lora_path {lora_request.lora_path!r}: target_modules {missing} do not exist in "
                             f"this {self.model_config.architecture} model.")
        self.requests[lora_id] = lora_request
        while len(self.cpu_loras) >= self.lora_config.max_cpu_loras:
            evicted, _ = self.cpu_loras.popitem(last=False)
            logger.debug("LoRA adapter %d evicted from the CPU cache", evicted)
        self.cpu_loras[lora_id] = model
        logger.info("Loaded LoRA adapter %r (id %d, r=%d, %d projections, %.2f MiB)", model.name, lora_id,
                    model.rank, len(model.weights), model.nbytes / 2**20)
        return model

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter: its slot is free for the next one (its weights stay there until then, so
        a step already built over it is unharmed)."""
        found = self.cpu_loras.pop(lora_int_id, None) is not None
        slot = self.slot_of.pop(lora_int_id, None)
        self.requests.pop(lora_int_id, None)
        self._last_key = None
        return found or slot is not None

    def list_loras(self) -> list[int]:
        return list(self.cpu_loras)

    # ---- the slots ----
    def prepare_step(self, loras: Sequence[LoRARequest | None], query_lens: Sequence[int]) -> None:
        """Put the step's adapters in slots and set each token's slot: request i computes query_lens[i]
        tokens under loras[i] (None: the base model)."""
        key = (tuple(lora.lora_int_id if lora is not None else 0 for lora in loras), tuple(query_lens))
        if key == self._last_key:
            return  # the same mix as the last step (a decode run): the same token slots
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        assert len(wanted) <= self.lora_config.max_loras, "the scheduler ran more adapters than max_loras"
        changed = False
        for lora_id, lora in wanted.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
            else:
                self._activate(lora, set(wanted))
                changed = True
        if changed:
            for target in self.targets:
                target.matmul.repack()
        if not wanted:
            self.context.set_token_slots(None)
        else:
            slots: list[int] = []
            for lora, count in zip(loras, query_lens):
                slots.extend([self.slot_of[lora.lora_int_id] if lora is not None else -1] * count)
            self.context.set_token_slots(torch.tensor(slots, device=self.device))
        self._last_key = key

    def _activate(self, lora: LoRARequest, in_use: set[int]) -> None:
        used = set(self.slot_of.values())
        free = [slot for slot in range(self.lora_config.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:
            victim = next(lora_id for lora_id in self.slot_of if lora_id not in in_use)
            slot = self.slot_of.pop(victim)
        model = self.add_lora(lora)  # in the CPU cache already unless evicted since its request came
        self._fill_slot(slot, model)
        self.slot_of[lora.lora_int_id] = slot

    def _fill_slot(self, slot: int, model: LoRAModel) -> None:
        """Copy the adapter into `slot` of every wrapped projection (zeros where it has no weights, and past
        its rank); the caller repacks the kernels' copies."""
        for target in self.targets:
            target.a[:, slot].zero_()
            target.b[:, slot].zero_()
            module = target.module
            out_offset = full_offset = 0
            # an adapter of a fused checkpoint: its one A serves every part, its B's rows split by part
            fused = model.weights.get((target.layer, target.name)) if len(target.parts) > 1 else None
            for p, part in enumerate(target.parts):
                pair = model.weights.get((target.layer, part))
                if isinstance(module, ColumnParallelLinear):
                    size, index = module.shard_sizes[p], module.shard_indices[p]
                    start = index * size
                    if pair is None and fused is not None:
                        pair, start = fused, full_offset + index * size
                    if pair is not None:
                        a, b = pair
                        r = a.shape[0]
                        target.a[p, slot, :r].copy_(a)
                        rows = b[start:start + size].float() * model.scaling
                        target.b[out_offset:out_offset + size, slot, :r].copy_(rows)
                    out_offset += size
                    full_offset += target.full_sizes[p]
                elif pair is not None:  # row-parallel: this rank's input columns of A
                    a, b = pair
                    r = a.shape[0]
                    n = module.input_size_per_rank
                    target.a[0, slot, :r].copy_(a[:, self.tp_rank * n:(self.tp_rank + 1) * n])
                    target.b[:, slot, :r].copy_(b.float() * model.scaling)
