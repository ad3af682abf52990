"""A SchedulerOutput on its way to the workers, and the request copies they keep.

The scheduler's plan refers to the engine's Request objects, which the workers never see: every
executor, the in-process one included, sends a WorkerSchedulerOutput, and each worker keeps its own copy
of each live request (CachedRequestState: token ids, sampling params, in the runner's InputBatch). A step
brings only what changed, as vLLM V1 does (NewRequestData / CachedRequestData): a request seen for the
first time comes whole (its prompt); later steps bring its counts only, because the worker appends the
tokens it samples itself (InputBatch), and the plan the block-table entries the KV cache manager wrote
since the last one. A step's message is therefore a few dozen bytes per request no matter how long the
request is, and the runner reads one request shape in one process and in many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pagedllm.core_types.scheduler_output import (
    NewRequestData,
    ScheduledRequestsData,
    SchedulerOutput,
    WorkerSchedulerOutput,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


class TokenRows(Protocol):
    """Where a worker's request states keep their tokens (worker/input_batch.InputBatch)."""

    token_ids: np.ndarray   # [rows, max_model_len]
    num_tokens: np.ndarray  # [rows]
    held_tokens: object     # not None: sampled tokens not yet in the arrays (flush_sampled writes them)

    def flush_sampled(self) -> None: ...


@dataclass(eq=False)
class CachedRequestState:
    """A worker's copy of a request: all that ModelRunner reads of it. Its tokens live in its row of the
    runner's InputBatch (the one copy, which the step's inputs are gathered from); the lists below are
    read from there."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    batch: TokenRows
    row: int
    num_prompt_logprobs_computed: int = 0
    lora_request: LoRARequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """The known tokens at positions [start, end) (fewer where end passes the last known one)."""
        batch = self._rows()
        return batch.token_ids[self.row, start:min(end, batch.num_tokens[self.row])].tolist()

    @property
    def all_token_ids(self) -> list[int]:
        batch = self._rows()
        return batch.token_ids[self.row, :batch.num_tokens[self.row]].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        batch = self._rows()
        return batch.token_ids[self.row, len(self.prompt_token_ids):batch.num_tokens[self.row]].tolist()

    def _rows(self) -> TokenRows:
        batch = self.batch
        if batch.held_tokens is not None:
            batch.flush_sampled()
        return batch


class SchedulerOutputEncoder:
    """Engine side: remembers which requests the workers hold, and the last plan's requests (a plan with
    the same ones, in the same order, sends None for their ids)."""

    def __init__(self) -> None:
        self.known_ids: set[str] = set()
        # The last plan's Requests, and whether any of them asked for prompt logprobs (fixed per request).
        self.requests: list[object] = []
        self.any_prompt_logprobs = False

    def encode(self, scheduler_output: SchedulerOutput) -> WorkerSchedulerOutput:
        known_ids = self.known_ids
        finished = scheduler_output.finished_req_ids
        if finished:
            known_ids.difference_update(finished)
        requests = scheduler_output.requests
        new_requests: list[NewRequestData] = []
        if requests == self.requests:
            # The same requests as the last plan (compared by identity, in C; every decode step of a
            # steady batch): all known to the workers, and their ids travel as None.
            request_ids = None
        else:
            request_ids = [request.request_id for request in requests]
            new_requests = [NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params,
                                           request.lora_request)
                            for request in requests if request.request_id not in known_ids]
            if new_requests:
                known_ids.update(new.request_id for new in new_requests)
            self.requests = list(requests)
            self.any_prompt_logprobs = any(request.prompt_logprobs is not None for request in requests)
        # the plan's own columns travel as they are
        scheduled = ScheduledRequestsData(
            request_ids, scheduler_output.num_new_tokens, scheduler_output.start_pos, scheduler_output.sample,
            scheduler_output.spec_token_ids,
            [request.num_prompt_logprobs_computed for request in requests] if self.any_prompt_logprobs else None)
        scheduled.compact()
        return WorkerSchedulerOutput(new_requests, scheduled,
                                     finished, scheduler_output.preempted_ids,
                                     scheduler_output.grammar_bitmask, scheduler_output.kv_connector_metadata,
                                     scheduler_output.block_table_changes)
