"""The scheduler's plan for one step (SchedulerOutput), and its compact form for workers in other
processes (WorkerSchedulerOutput: new requests whole, the others as deltas, as vLLM V1's
NewRequestData / CachedRequestData)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any, Protocol

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
    """The plan for one step, as columns (vLLM V1's counts per request): request i of `requests` computes
    num_new_tokens[i] tokens from position start_pos[i]; it samples unless sample[i] is False (a prompt
    chunk short of its last known token), and verifies the proposals spec_token_ids[i] where it has
    some. A column that says nothing is None (every request samples; none verifies), as it travels to
    the workers (ScheduledRequestsData). The step's per-request loops read the columns; `scheduled` gives
    the same plan as one object per request, for the readers that want them (a KV connector's saves, a
    grammar's masks, a failed step's retries)."""

    requests: list[Any]      # the engine's Requests (RunnerRequest-like: request_id, tokens, sampling params)
    num_new_tokens: list[int]
    start_pos: list[int]
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    sample: list[bool] | None = None
    spec_token_ids: list[list[int]] | None = None
    # Each request's block table, for a KV connector's saves (None without one; the KV cache manager's own
    # lists, read during this step only). The runner keeps its own copy from block_table_changes.
    block_ids: list[Sequence[int]] | None = None
    # Requests that left the engine since the last step: workers in other processes drop their copies.
    finished_req_ids: set[str] = field(default_factory=set)
    # Allowed tokens of the rows that sample under a grammar (None when no scheduled request has one).
    grammar_bitmask: GrammarBitmask | None = None
    # The KV connector's loads and saves for this step (None without a connector).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Block tables written since the last plan, one dict per KV cache group (KVCacheManager.take_table_changes;
    # empty when none changed).
    block_table_changes: list[dict[str, tuple[int, list[int]]]] = field(default_factory=list)

    def add(self, request: Any, num_new_tokens: int, start_pos: int, sample: bool, spec_token_ids: list[int]) -> None:
        """Append a request to the plan (a column that said nothing starts saying it here)."""
        index = len(self.requests)
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.start_pos.append(start_pos)
        if not sample and self.sample is None:
            self.sample = [True] * index
        if self.sample is not None:
            self.sample.append(sample)
        if spec_token_ids and self.spec_token_ids is None:
            self.spec_token_ids = [[] for _ in range(index)]
        if self.spec_token_ids is not None:
            self.spec_token_ids.append(spec_token_ids)

    @classmethod
    def of(cls, scheduled: Sequence[ScheduledRequest], **fields: Any) -> SchedulerOutput:
        """The plan of these requests (and the other fields given)."""
        plan = cls([], [], [], **fields)
        for s in scheduled:
            plan.add(s.request, s.num_new_tokens, s.start_pos, s.sample, s.spec_token_ids)
        if any(s.block_ids for s in scheduled):
            plan.block_ids = [s.block_ids for s in scheduled]
        return plan

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """The plan as one object per request, in its order."""
        return [ScheduledRequest(request, num_new, start, block_ids, sample, list(spec) if spec else [])
                for request, num_new, start, block_ids, sample, spec in zip(
                    self.requests, self.num_new_tokens, self.start_pos, self.block_ids or repeat(()),
                    self.sample or repeat(True), self.spec_token_ids or repeat(None))]

    @property
    def is_empty(self) -> bool:
        return not self.requests


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

    def compact(self) -> None:
        """Columns that say nothing become None."""
        if self.sample is not None and all(self.sample):
            self.sample = None
        if self.spec_token_ids is not None and not any(self.spec_token_ids):
            self.spec_token_ids = None
        if self.num_prompt_logprobs_computed is not None and not any(self.num_prompt_logprobs_computed):
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
