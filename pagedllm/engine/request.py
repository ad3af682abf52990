"""A request as the scheduler sees it: tokens known so far, how many have KV, and where it stands."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.kv_cache.hashing import BlockHash
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PositionLogprobs, RequestMetrics
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # its prompt's blocks are being loaded by a KV connector
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        # a tuple scan by identity: Enum.value is a Python-level descriptor, and this runs for every
        # request every step
        return self in _FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}
_FINISHED_STATUSES = tuple(_FINISH_REASONS)


@dataclass(eq=False, slots=True, weakref_slot=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    prompt: str | None = None
    # Parallel sampling (n > 1): the user request this is sample `index` of (EngineCore.add_request makes
    # one request per sample; they share the prompt through the prefix cache).
    parent_id: str | None = None
    index: int = 0
    # Nobody reads its tokens before it ends (see EngineCore.defer_final_outputs): the core sends its
    # output once, when it finishes, instead of a delta every step.
    defer_outputs: bool = False
    # The PEFT adapter it runs under (None: the base model); its id keys its prefix-cache blocks
    lora_request: LoRARequest | None = None
    # The rest is the request's state, declared here for the slots (a slotted object keeps its attributes in
    # itself, which the per-step loops over every running request reach with fewer cache misses than an
    # attribute dict); those derived from the fields above are set in __post_init__.
    # Attributes, not properties: read for every running request every step.
    num_prompt_tokens: int = field(init=False)
    # Set by the scheduler when it takes the request (Scheduler._watch_stops): the token ids that may end
    # it and the token count that does, so that a step's other tokens skip the whole stop test.
    stop_candidates: frozenset[int] = field(init=False, default=frozenset())
    length_cap: int = field(init=False, default=0)
    output_token_ids: list[int] = field(init=False, default_factory=list)
    _all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(init=False, default=0)
    num_cached_tokens: int = field(init=False, default=-1)  # prefix-cache hit at first admission; -1 until then
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    stop_reason: int | str | None = field(init=False, default=None)
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)
    spec_token_ids: list[int] = field(init=False, default_factory=list)
    # Async scheduling: tokens sampled by steps still running, not known here yet. The worker has
    # them (it appends what it samples), so the next step can already compute them.
    num_output_placeholders: int = field(init=False, default=0)
    logprobs: list[PositionLogprobs] | None = field(init=False)
    cumulative_logprob: float = field(init=False, default=0.0)
    prompt_logprobs: list[PositionLogprobs | None] | None = field(init=False)
    metrics: RequestMetrics = field(init=False)
    num_preemptions: int = field(init=False, default=0)
    num_sent_tokens: int = field(init=False, default=0)  # output tokens already sent to the API process
    # Disaggregated prefill: what the client sent for a KV connector, and what the response carries.
    kv_transfer_params: dict | None = field(init=False)
    kv_transfer_params_out: dict | None = field(init=False, default=None)
    num_external_tokens: int = field(init=False, default=0)  # prompt tokens a KV connector loads for it

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        self.logprobs = [] if params.logprobs is not None else None
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.kv_transfer_params = (params.extra_args or {}).get("kv_transfer_params")

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prompt_logprobs_computed(self) -> int:
        return len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids) + self.num_output_placeholders

    def append_output_token(self, token_id: int) -> int:
        """Append a sampled token; returns the request's token count."""
        self.output_token_ids.append(token_id)
        all_token_ids = self._all_token_ids
        all_token_ids.append(token_id)
        return len(all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample `index` of a request with n > 1: one sample, and its own seed (the
    request's seed + index) where seeded, so each sample's output is reproducible on its own."""
    params = params.clone()
    params.n = 1
    if params.seed is not None:
        params.seed = (params.seed + index + 2**63) % 2**64 - 2**63  # stays a valid torch seed
    return params
