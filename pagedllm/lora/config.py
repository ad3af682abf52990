"""LoRAConfig: the engine's LoRA limits (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's allowed ranks are powers of two up to 512; any positive rank reads the same here.
MAX_SUPPORTED_LORA_RANK = 512


@dataclass
class LoRAConfig:
    max_loras: int = 1          # adapters on the device at once; also the most distinct adapters in one step
    max_lora_rank: int = 16     # the slots' rank: every adapter's r must be at most this
    max_cpu_loras: int | None = None  # adapters kept read in CPU memory (an LRU); None: max_loras
    lora_dtype: torch.dtype | None = None  # None: the model's dtype

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {self.max_loras!r}.")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_SUPPORTED_LORA_RANK:
            raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_SUPPORTED_LORA_RANK}], "
                             f"got {self.max_lora_rank!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras "
                             f"({self.max_loras}).")
