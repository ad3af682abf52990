"""A SchedulerOutput on its way to workers in other processes, and the request copies they keep.

The scheduler's plan refers to the engine's Request objects. A worker process keeps its own copy of each
live request (CachedRequestState: token ids, sampling params, its seeded generator) and each step receives
only what changed, as vLLM V1 does (NewRequestData / CachedRequestData): a request seen for the first
time comes whole, later steps bring just the tokens appended since (sampled tokens, by rank 0 a step
ago; with async scheduling the worker appends its own sampled tokens instead, see append_sampled)
and the counts, and the plan the block-table entries the KV cache manager wrote since the last
one. A step's message is therefore a few dozen bytes per request no matter how long the request is.
Rebuilt on the worker, the plan has the very shape ModelRunner reads, so the runner code is the same in
one process and in many.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

import torch

from pagedllm.distributed.kv_transfer.base import KVConnectorMetadata
from pagedllm.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GrammarBitmask


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None


@dataclass
class ScheduledRequestsData:
    """The step's scheduled requests as columns, entry i for request i: one object to pickle instead of
    one per request (unpickling 64 per-request objects cost the worker ~0.2 ms a step, on its critical
    path under async scheduling). A column that says nothing (every entry empty, zero or True) travels as
    None, and request_ids as None when they are the previous plan's, in its order: a steady decode step's
    plan is then two lists of ints (SchedulerOutputEncoder.encode, RequestStates.apply)."""

    request_ids: list[str] | None = field(default_factory=list)
    new_token_ids: list[list[int]] | None = field(default_factory=list)  # appended since the worker last saw it
    num_new_tokens: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    sample: list[bool] | None = field(default_factory=list)
    spec_token_ids: list[list[int]] | None = field(default_factory=list)
    num_prompt_logprobs_computed: list[int] | None = field(default_factory=list)

    def compact(self, previous_request_ids: list[str] | None) -> None:
        if self.request_ids == previous_request_ids:
            self.request_ids = None
        if not any(self.new_token_ids):  # type: ignore[arg-type]
            self.new_token_ids = None
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
    blocks_to_copy: list[tuple[int, int]]
    finished_req_ids: set[str]
    preempted_ids: list[str]
    grammar_bitmask: GrammarBitmask | None
    kv_connector_metadata: KVConnectorMetadata | None = None
    block_table_changes: list[dict[str, tuple[int, list[int]]]] = field(default_factory=list)  # per KV cache group

    def continues_decode(self) -> bool:
        """Whether the plan runs the last plan's requests, in its order, given nothing new (no tokens from
        the engine, proposals, prompt logprobs, grammar, KV transfers, block copies, requests that came or
        went): a steady decode step under async scheduling (ModelRunner.execute_continued_decode checks
        the rest)."""
        columns = self.scheduled
        return (columns.request_ids is None and columns.new_token_ids is None and columns.sample is None
                and columns.spec_token_ids is None and columns.num_prompt_logprobs_computed is None
                and not self.new_requests and not self.finished_req_ids and not self.preempted_ids
                and not self.blocks_to_copy and self.grammar_bitmask is None and self.kv_connector_metadata is None)


@dataclass(eq=False)
class CachedRequestState:
    """A worker's copy of a request: what ModelRunner reads from the engine's Request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    all_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None   # created by the runner on first use when seeded
    num_prompt_logprobs_computed: int = 0
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        self.always_argmax = self.sampling_params.always_argmax  # as Request's

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]


class SchedulerOutputEncoder:
    """Engine side: remembers how many tokens of each request the workers have, and the last plan's
    request ids (in its order: the order of a packed answer's tokens, see pack_output)."""

    def __init__(self) -> None:
        self.num_sent_tokens: dict[str, int] = {}
        self.request_ids: list[str] | None = None

    def encode(self, scheduler_output: SchedulerOutput) -> WorkerSchedulerOutput:
        for request_id in scheduler_output.finished_req_ids:
            self.num_sent_tokens.pop(request_id, None)
        new_requests = []
        scheduled = ScheduledRequestsData()
        num_sent_tokens = self.num_sent_tokens
        for s in scheduler_output.scheduled:
            request = s.request
            request_id = request.request_id
            sent = num_sent_tokens.get(request_id)
            if sent is None:
                new_requests.append(NewRequestData(request_id, request.prompt_token_ids, request.sampling_params,
                                                   request.lora_request))
                sent = request.num_prompt_tokens
            # With async scheduling the worker appends the tokens it samples itself: those of steps still
            # running (placeholders here) are the worker's already, and are never sent.
            num_sent_tokens[request_id] = request.num_tokens + request.num_output_placeholders
            scheduled.request_ids.append(request_id)
            scheduled.new_token_ids.append(request.all_token_ids[sent:])
            scheduled.num_new_tokens.append(s.num_new_tokens)
            scheduled.start_pos.append(s.start_pos)
            scheduled.sample.append(s.sample)
            scheduled.spec_token_ids.append(s.spec_token_ids)
            scheduled.num_prompt_logprobs_computed.append(request.num_prompt_logprobs_computed)
        request_ids = scheduled.request_ids
        scheduled.compact(self.request_ids)
        self.request_ids = request_ids
        return WorkerSchedulerOutput(new_requests, scheduled, scheduler_output.blocks_to_copy,
                                     scheduler_output.finished_req_ids, scheduler_output.preempted_ids,
                                     scheduler_output.grammar_bitmask, scheduler_output.kv_connector_metadata,
                                     scheduler_output.block_table_changes)


class RequestStates:
    """Worker side: the live requests, and the plan rebuilt over them."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.request_ids: list[str] = []  # the last plan's, in its order
        self.scheduled_states: list[CachedRequestState] = []  # the same requests' states

    def apply(self, message: WorkerSchedulerOutput) -> SchedulerOutput:
        for request_id in message.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in message.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, new.prompt_token_ids, new.sampling_params, list(new.prompt_token_ids),
                lora_request=new.lora_request)
        scheduled = []
        columns = message.scheduled
        requests = self.requests
        if columns.request_ids is not None:
            self.request_ids = columns.request_ids
        states = []
        for request_id, new_token_ids, num_new, start, sample, spec, num_prompt_lp in zip(
                self.request_ids, columns.new_token_ids or repeat(None), columns.num_new_tokens,
                columns.start_pos, columns.sample or repeat(True), columns.spec_token_ids or repeat(None),
                columns.num_prompt_logprobs_computed or repeat(0)):
            state = requests[request_id]
            states.append(state)
            if new_token_ids:
                state.all_token_ids.extend(new_token_ids)
            state.num_prompt_logprobs_computed = num_prompt_lp
            scheduled.append(ScheduledRequest(state, num_new, start, [], sample,  # type: ignore[arg-type]
                                              spec if spec is not None else []))
        self.scheduled_states = states
        return SchedulerOutput(scheduled=scheduled, num_batched_tokens=sum(columns.num_new_tokens),
                               blocks_to_copy=message.blocks_to_copy, preempted_ids=message.preempted_ids,
                               finished_req_ids=message.finished_req_ids, grammar_bitmask=message.grammar_bitmask,
                               kv_connector_metadata=message.kv_connector_metadata,
                               block_table_changes=message.block_table_changes)

    def append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Async scheduling: a step's sampled tokens, appended as soon as they exist, because the next
        plan (made before the engine saw them) already computes them."""
        for request_id, token_ids in sampled_token_ids.items():
            self.requests[request_id].all_token_ids.extend(token_ids)

    def append_decoded(self, token_ids: list[int]) -> None:
        """append_sampled for a step that sampled one token for each request of the last plan, in its order
        (a continued decode)."""
        for state, token_id in zip(self.scheduled_states, token_ids):
            state.all_token_ids.append(token_id)


def pack_output(output: ModelRunnerOutput, request_ids: list[str]) -> ModelRunnerOutput | tuple[list[int], float]:
    """A step's answer on its way back. When every request of the plan took exactly one token and nothing
    else came out (the common decode step), the tokens alone, in the plan's order, and the forward's
    seconds: 64 ints to pickle on the worker's critical path instead of 64 ids and 64 lists."""
    sampled = output.sampled_token_ids
    if (len(sampled) == len(request_ids) and output.kv_connector_output is None
            and not (output.logprobs or output.sampled_logprobs or output.prompt_logprobs or output.spec_token_ids
                     or output.num_draft_tokens or output.num_accepted_tokens)
            and list(sampled) == request_ids and all(len(tokens) == 1 for tokens in sampled.values())):
        return [token for (token,) in sampled.values()], output.forward_s
    return output


def unpack_output(answer: ModelRunnerOutput | tuple[list[int], float], request_ids: list[str]) -> ModelRunnerOutput:
    """pack_output's inverse, on the engine's side (which knows the plan's request ids)."""
    if isinstance(answer, ModelRunnerOutput):
        return answer
    token_ids, forward_s = answer
    sampled = {request_id: [token] for request_id, token in zip(request_ids, token_ids)}
    return ModelRunnerOutput(sampled_token_ids=sampled, forward_s=forward_s)
