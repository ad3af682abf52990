"""LoRARequest: which adapter a request runs under, with vLLM's fields and positional order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest(lora_name, lora_int_id, lora_path)`, vLLM's fields in vLLM's order. lora_int_id
    identifies the adapter everywhere inside the engine (slots, the CPU cache, prefix-cache keys): it
    must be at least 1 and name one adapter for the engine's life, as in vLLM."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None  # vLLM's older name for lora_path (same positional place)
    long_lora_max_len: int | None = None  # vLLM's long-context LoRA: not supported
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_path and self.lora_local_path:
            object.__setattr__(self, "lora_path", self.lora_local_path)
        if self.long_lora_max_len is not None:
            raise ValueError("long_lora_max_len is not supported: long-context LoRA adapters are not served.")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")
        if not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must name its directory.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __hash__(self) -> int:
        return hash(self.lora_int_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id
