"""What the proposers share: the request they draft for, and the model runner a draft model runs on.

A leaf: the worker hands a draft model's runner in through the DraftRunner interface, so spec_decode/
never imports the worker (the worker imports spec_decode, as in vLLM V1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedllm.core_types.scheduler_output import ScheduledRequest


@dataclass
class DraftRequest:
    """A request as the proposers see it at the end of a step: its tokens with this step's sampled ones."""

    request_id: str
    all_token_ids: list[int]
    sampling_params: SamplingParams
    num_prompt_tokens: int = 0


class DraftBlockTables(Protocol):
    def apply(self, changes: dict[str, tuple[int, list[int]]]) -> None: ...

    def drop(self, request_ids: Iterable[str]) -> None: ...


class DraftRunner(Protocol):
    """The draft model's runner, as DraftModelProposer drives it: its own KV pool and block tables,
    prepare + forward of a plan, and the model's logits. The worker's ModelRunner is one."""

    model_config: ModelConfig
    cache_config: CacheConfig
    block_size: int
    block_tables: DraftBlockTables
    model: Any         # argmax_logits(hidden) and compute_logits(hidden)
    sampler: Any       # its `generator` (unseeded random draws)
    kv_caches: list[torch.Tensor]

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def kv_cache_bytes_per_block(self) -> int: ...

    def weight_bytes(self) -> int: ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    def prepare(self, scheduled: list[ScheduledRequest]) -> Any: ...  # a batch for forward()

    def forward(self, batch: Any) -> torch.Tensor: ...
