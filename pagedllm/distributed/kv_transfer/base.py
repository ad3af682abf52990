"""The KV connector interface (vLLM V1's KVConnectorBase_V1, split the same way into two halves).

Scheduler side (policy, no tensors), called by the Scheduler:
- get_num_new_matched_tokens(request, num_computed_tokens): how many more of the prompt's tokens can be
  loaded from elsewhere; the scheduler allocates their blocks first, before anything is computed;
- update_state_after_alloc(request, block_ids, num_external_tokens): which local blocks a load fills;
- build_connector_meta(scheduled): this step's loads and saves, handed to the worker with the plan;
- update_connector_output(output): the worker's finished and failed transfers since the last step;
- request_finished(request): the kv_transfer_params the response carries (where to pull the blocks).

Worker side (tensors, no policy), called by the ModelRunner around each forward pass:
- start_load_kv(metadata): start loading blocks in the background; the requests wait, others run;
- save_kv_layer(layer, tensors, metadata): after the forward pass, keep each layer's blocks of the
  requests whose prompt just finished, for a consumer to pull;
- get_finished(wait): transfers that ended since the last call.

A layer's KV is "the list of tensors that hold its blocks", each with the block index on dim 2 (K and V
today; a quantized cache's scales can join the list), moved as raw bytes in the cache's own dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Every KV tensor a connector moves holds one block per index of this dimension.
BLOCK_DIM = 2


@dataclass
class LoadSpec:
    """Pull blocks [first_block, first_block + len(block_ids)) of a request a producer saved, into
    the local `block_ids` (the ones the local prefix cache did not already hold)."""

    request_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    first_block: int
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Keep the blocks holding a request's first `num_tokens` tokens for a consumer to pull."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVConnectorMetadata:
    reqs_to_load: list[LoadSpec] = field(default_factory=list)
    reqs_to_save: list[SaveSpec] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.reqs_to_load and not self.reqs_to_save


@dataclass
class KVTransfer:
    """One finished transfer, for the metrics: bytes moved and how long it took."""

    direction: str  # "sent" or "received"
    num_bytes: int
    seconds: float


@dataclass
class KVConnectorOutput:
    """What the worker's connector reports back with a step's output."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_saving: set[str] = field(default_factory=set)
    failed_saving: set[str] = field(default_factory=set)
    transfers: list[KVTransfer] = field(default_factory=list)


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   max_tokens: int) -> tuple[int, bool]:
        """(tokens past `num_computed_tokens` and up to `max_tokens` that can be loaded, whether the
        load is asynchronous: the request then waits for it while others run)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The blocks now allocated to the request; the last ones receive the loaded tokens."""

    @abstractmethod
    def build_connector_meta(self, scheduled: Sequence[Any]) -> KVConnectorMetadata:
        """This step's transfers (loads recorded since the last call, saves of finished prompts)."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Record what the worker reported (finished saves, transfer figures)."""

    @abstractmethod
    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """The kv_transfer_params for the request's response (None: nothing to pull)."""


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, layers: list[list[torch.Tensor]]) -> None:
        """Every layer's block tensors (block index on BLOCK_DIM)."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer: int, metadata: KVConnectorMetadata) -> None: ...

    @abstractmethod
    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """After every layer was saved: the step's saves are complete (or reported failed)."""

    @abstractmethod
    def get_finished(self, wait: bool) -> KVConnectorOutput:
        """Transfers that ended since the last call; `wait`: nothing else to do this step, so block a
        moment for one to end instead of letting the engine spin."""

    @abstractmethod
    def staging_stats(self) -> tuple[int, int]:
        """(requests, bytes) saved and not pulled yet."""

    @abstractmethod
    def shutdown(self) -> None: ...
