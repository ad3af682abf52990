"""The scheduler's plan for one step (SchedulerOutput), and its compact form for workers in other
processes (WorkerSchedulerOutput: new requests whole, the others as deltas, as vLLM V1's
NewRequestData / CachedRequestData)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:

    from pagedllm.structured_output import GrammarBitmask


class RunnerRequest(Protocol):
    """What the model runner reads of a scheduled request: the worker's CachedRequestState (and the
    drafter's DraftSeq, which its runner prepares as a batch)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None
    num_prompt_logprobs_computed: int

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    def token_slice(self, start: int, end: int) -> Sequence[int]:
        """The known tokens at positions [start, end) (fewer where end passes the last known one)."""
        ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclass(slots=True)
class ScheduledRequest:
    request: RunnerRequest
    num_new_tokens: int      # tokens whose KV is computed this step, speculative ones included
    start_pos: int           # num_computed_tokens before this step
    # The request's block table, for the KV connector's saves (empty without one: nothing else reads it;
    # the runner keeps its own copy from SchedulerOutput.block_table_changes).
    block_ids: Sequence[int]
    sample: bool             # this step reaches the last known token, so it yields new tokens
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str]
    # Requests that left the engine since the last step: workers in other processes drop their copies.
    finished_req_ids: set[str] = field(default_factory=set)
    # Allowed tokens of the rows that sample under a grammar (None when no scheduled request has one).
    grammar_bitmask: GrammarBitmask | None = None
    # The KV connector's loads and saves for this step (None without a connector).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Block tables written since the last plan, one dict per KV cache group (KVCacheManager.take_table_changes;
    # empty when none changed): the runner's copy of the tables is kept from these, not from each
    # ScheduledRequest's block_ids.
    block_table_changes: list[dict[str, tuple[int, list[int]]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None


@dataclass
class ScheduledRequestsData:
    """The step's scheduled requests as columns, entry i for request i: one object to pickle instead of
    one per request (unpickling is on the worker's critical path under async scheduling). A column that
    says nothing (every entry empty, zero or True) travels as None, and request_ids as None when they are
    the previous plan's, in its order: a decode step's plan is then two lists of ints
    (SchedulerOutputEncoder.encode, InputBatch.update). No sampled token travels: the worker appends its
    own."""

    request_ids: list[str] | None = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    sample: list[bool] | None = field(default_factory=list)
    spec_token_ids: list[list[int]] | None = field(default_factory=list)
    num_prompt_logprobs_computed: list[int] | None = field(default_factory=list)

    def compact(self, previous_request_ids: list[str] | None) -> None:
        if self.request_ids == previous_request_ids:
            self.request_ids = None
        if all(self.sample):  # type: ignore[arg-type]
            self.sample = None
        if not any(self.spec_token_ids):  # type: ignore[arg-type]
            self.spec_token_ids = None
        if not any(self.num_prompt_logprobs_computed):  # type: ignore[arg-type]
            self.num_prompt_logprobs_computed = None


@dataclass
class WorkerSchedulerOutput:
    new_requests: list[NewRequestData]
    scheduled: ScheduledRequestsData
    finished_req_ids: set[str]
    preempted_ids: list[str]
    grammar_bitmask: GrammarBitmask | None
    kv_connector_metadata: KVConnectorMetadata | None = None
    block_table_changes: list[dict[str, tuple[int, list[int]]]] = field(default_factory=list)  # per KV cache group
