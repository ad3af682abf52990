"""The worker's persistent input batch (vLLM V1's InputBatch): every live request's state and its row of
preallocated arrays, kept from the scheduler's deltas (WorkerSchedulerOutput).

A request gets a row when the worker first hears of it (its prompt, or the KV cache manager's first
block-table change for it) and keeps it until it finishes; a preempted request keeps its row and its
tokens, and the manager rewrites its table when it is admitted again. A freed row is reused by the next
request. Rows are not condensed: every step gathers its requests' rows by index, in the plan's order
(the order sampling draws its random numbers in), so a dense prefix of rows would buy nothing.

Per row: the request's token ids (prompt and outputs: the worker's one copy, which its state reads) and
how many there are (a decode step computes each row's last one, so its inputs are gathered from these
two arrays in one C++ call, worker/step_inputs.py), its block table in each KV cache group
(worker/block_table.py), whether it takes the argmax of its raw logits (`greedy`: greedy sampling asking
for nothing that changes or reports the logits) and the sampler's filter parameters (temperature, top-k,
top-p, min-p). A step of unchanged requests reuses the last plan's rows (and their tensor and greedy
flag); what changes is written in place.

The worker appends the tokens it samples itself (as vLLM V1's runner does), in process and out, with
async scheduling or without: the engine sends a request's prompt once and never a sampled token. A
decode step's tokens (one per row of its plan, a tensor) are held until the next step's input gather
appends them in the same C++ call (ModelRunner._prepare_plan); anything else that reads the rows first
(a request state's token lists, another kind of step, a plan with other rows) appends them before it
reads (flush_sampled).
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from pagedllm.core_types.scheduler_output import ScheduledRequest, ScheduledRequestsData, WorkerSchedulerOutput
from pagedllm.layers.sampler import FilterParams
from pagedllm.worker.block_table import BlockTables
from pagedllm.worker.request_state import CachedRequestState
from pagedllm.worker.step_inputs import append_tokens

# A top_k may not fit an int64; every value at or past the vocabulary size means the same (off), so it
# is capped here and clamped to the vocabulary when read (filter_params).
_MAX_TOP_K = 2**62


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, num_groups: int = 1,
                 block_tables: BlockTables | None = None):
        self.requests: dict[str, CachedRequestState] = {}
        self.block_tables = block_tables or BlockTables(max_num_reqs, max_blocks_per_req, num_groups)
        num_rows = self.block_tables.table.shape[0]
        # np.zeros is calloc'd: rows of short requests never touch the pages of their unused tail.
        self.token_ids = np.zeros((num_rows, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self._tensors()
        self.greedy = np.zeros(num_rows, dtype=bool)
        # The sampler's filter parameters (layers/sampler.FilterParams); float64 holds each Python float
        # exactly, so the cast to the logits' dtype gives the tensor the sampler makes from the floats.
        self.temperature = np.zeros(num_rows, dtype=np.float64)
        self.top_k = np.zeros(num_rows, dtype=np.int64)
        self.top_p = np.zeros(num_rows, dtype=np.float64)
        self.min_p = np.zeros(num_rows, dtype=np.float64)
        self.num_prompt_tokens = np.zeros(num_rows, dtype=np.int64)
        # The last plan: its request ids (in its order), their states and rows. A plan that names no ids
        # runs the same requests (ScheduledRequestsData.request_ids).
        self.request_ids: list[str] = []
        self.states: list[CachedRequestState] = []
        self.rows: list[int] = []
        self.rows_array = np.zeros(0, dtype=np.int64)
        self.rows_tensor = torch.from_numpy(self.rows_array)
        self.plan_greedy = True  # every row of the last plan takes the argmax of its raw logits
        # A decode step's sampled tokens, one per row of the plan (rows_tensor), not yet in token_ids
        self.held_tokens: torch.Tensor | None = None
        # states whose prompt-logprob count a plan set (reset when a plan sends none)
        self._prompt_logprob_states: list[CachedRequestState] = []

    def update(self, message: WorkerSchedulerOutput) -> None:
        """Apply a step's deltas."""
        columns = message.scheduled
        # (the same ids may name a new request: one that finished and one that reused its id)
        new_plan = bool(columns.request_ids is not None or message.new_requests or message.finished_req_ids)
        if new_plan:
            self.flush_sampled()  # held tokens belong to the last plan's rows
        if message.finished_req_ids:
            for request_id in message.finished_req_ids:
                self.requests.pop(request_id, None)
            self.block_tables.drop(message.finished_req_ids)
        for new in message.new_requests:
            row = self._row(new.request_id)
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, new.prompt_token_ids, new.sampling_params, self, row, lora_request=new.lora_request)
            params = new.sampling_params
            self.greedy[row] = params.always_argmax
            self.temperature[row], self.top_p[row], self.min_p[row] = params.temperature, params.top_p, params.min_p
            self.top_k[row] = min(params.top_k, _MAX_TOP_K)
            self.num_prompt_tokens[row] = len(new.prompt_token_ids)
            self._write_tokens(row, 0, new.prompt_token_ids)
        if message.block_table_changes:
            for group_changes in message.block_table_changes:
                for request_id in group_changes:
                    self._row(request_id)
            self.block_tables.apply(message.block_table_changes)
        if new_plan:
            if columns.request_ids is not None:
                self.request_ids = columns.request_ids
            self.states = [self.requests[request_id] for request_id in self.request_ids]
            self.rows = self.block_tables.rows(self.request_ids)
            self.rows_array = np.array(self.rows, dtype=np.int64)
            self.rows_tensor = torch.from_numpy(self.rows_array)
            self.plan_greedy = self.all_greedy(self.rows_array)
        if columns.num_prompt_logprobs_computed is not None:
            for state, num_prompt_lp in zip(self.states, columns.num_prompt_logprobs_computed):
                state.num_prompt_logprobs_computed = num_prompt_lp
            self._prompt_logprob_states = self.states
        elif self._prompt_logprob_states:
            for state in self._prompt_logprob_states:
                state.num_prompt_logprobs_computed = 0
            self._prompt_logprob_states = []

    def plan(self, columns: ScheduledRequestsData) -> list[ScheduledRequest]:
        """The plan of the step just applied (update), over the worker's request states, in its order."""
        return [ScheduledRequest(state, num_new, start, (), sample, spec if spec is not None else [])
                for state, num_new, start, sample, spec in zip(
                    self.states, columns.num_new_tokens, columns.start_pos, columns.sample or repeat(True),
                    columns.spec_token_ids or repeat(None))]

    def hold_sampled(self, token_ids: torch.Tensor) -> None:
        """A decode step's sampled tokens, token_ids[i] for row i of the plan (int64 [requests]): appended
        by the next decode step's input gather, or by flush_sampled when something reads the rows first."""
        assert self.held_tokens is None
        self.held_tokens = token_ids

    def take_held_tokens(self) -> torch.Tensor | None:
        """The held tokens, for the decode step's gather that appends them (step_inputs.decode_step_inputs)."""
        held, self.held_tokens = self.held_tokens, None
        return held

    def flush_sampled(self) -> None:
        """Append the held tokens (if any) to their rows now."""
        if self.held_tokens is not None:
            append_tokens(self.token_tensor, self.num_tokens_tensor, self.rows_tensor, self.take_held_tokens())

    def append_sampled(self, sampled_token_ids: list[list[int]]) -> None:
        """A step's sampled tokens, in the plan's order (ModelRunnerOutput's: any number each, accepted
        proposals and the bonus token)."""
        for row, token_ids in zip(self.rows, sampled_token_ids):
            if token_ids:
                self._write_tokens(row, int(self.num_tokens[row]), token_ids)

    def all_greedy(self, rows: list[int] | np.ndarray) -> bool:
        """Whether every one of these rows takes the argmax of its raw logits."""
        return bool(self.greedy[rows].all())

    def filter_params(self, rows: list[int], dtype: torch.dtype, device: torch.device, vocab: int) -> FilterParams:
        """These rows' temperature, top-k (clamped to `vocab`), top-p and min-p, for the sampler."""
        index = np.array(rows, dtype=np.int64)

        def tensor(values: np.ndarray, to_dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(values).to(dtype=to_dtype, device=device)

        return FilterParams(tensor(self.temperature[index], dtype),
                            tensor(np.minimum(self.top_k[index], vocab), torch.long),
                            tensor(self.top_p[index], dtype), tensor(self.min_p[index], dtype))

    def _write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        end = start + len(token_ids)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def _tensors(self) -> None:
        """Tensors sharing the token arrays' memory, for the step-input op."""
        self.token_tensor = torch.from_numpy(self.token_ids)
        self.num_tokens_tensor = torch.from_numpy(self.num_tokens)

    def _row(self, request_id: str) -> int:
        row = self.block_tables.row(request_id)
        if row >= len(self.greedy):  # the block tables grew their rows
            num_rows = self.block_tables.table.shape[0]
            self.token_ids = np.concatenate([self.token_ids, np.zeros((num_rows - len(self.greedy),
                                                                       self.token_ids.shape[1]), dtype=np.int64)])
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros(num_rows - len(self.greedy), dtype=np.int64)])
            self._tensors()
            for name in ("greedy", "temperature", "top_k", "top_p", "min_p", "num_prompt_tokens"):
                setattr(self, name, np.resize(getattr(self, name), num_rows))
        return row
