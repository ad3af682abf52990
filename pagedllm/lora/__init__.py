"""Multi-LoRA serving: PEFT adapters on one base model, several of them (and the base) in one batch.

- request.py: LoRARequest, the name a request carries (vLLM's).
- peft.py: reads and validates a PEFT adapter directory into the model's fused projection layout.
- layers.py: the batched shrink/expand added to a projection's output (Punica / S-LoRA).
- manager.py: the adapters' slots on the device and an LRU of adapters in CPU memory.
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
