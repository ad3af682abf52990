"""Roofline and KV-capacity planner: `pagedllm plan`, and the arithmetic the benchmarks reuse."""

from pagedllm.planner.roofline import (
    ModelSpec,
    decode_bytes_per_token,
    kv_bytes_per_token,
    ridge_point,
    speculative_tokens_per_pass,
    weight_bytes,
)

__all__ = [
    "ModelSpec",
    "decode_bytes_per_token",
    "kv_bytes_per_token",
    "ridge_point",
    "speculative_tokens_per_pass",
    "weight_bytes",
]
