"""The worker's persistent input batch (worker/input_batch.py), fed the deltas an executor sends."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.core_types.scheduler_output import (
    NewRequestData,
    ScheduledRequestsData,
    WorkerSchedulerOutput,
)
from pagedllm.worker.input_batch import InputBatch


def update(batch: InputBatch, step: WorkerSchedulerOutput) -> list:
    """Apply a step's deltas; its plan over the batch's request states."""
    batch.update(step)
    return batch.plan(step.scheduled)


def message(new: list[NewRequestData], ids: list[str] | None, num_new: list[int], start: list[int],
            finished: set[str] | None = None,
            table_changes: list[dict[str, tuple[int, list[int]]]] | None = None) -> WorkerSchedulerOutput:
    columns = ScheduledRequestsData(request_ids=ids, num_new_tokens=num_new,
                                    start_pos=start, sample=None, spec_token_ids=None,
                                    num_prompt_logprobs_computed=None)
    return WorkerSchedulerOutput(new, columns, finished or set(), [], None,
                                 block_table_changes=table_changes or [])


def test_rows_follow_requests_through_arrival_finish_and_reuse() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_blocks_per_req=4)
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=1)
    plan = update(batch, message([NewRequestData("a", [1, 2, 3], greedy), NewRequestData("b", [4, 5], sampled)],
                                ["a", "b"], [3, 2], [0, 0], table_changes=[{"a": (0, [7]), "b": (0, [8])}]))
    assert [s.request.request_id for s in plan] == ["a", "b"]
    rows = batch.rows
    assert batch.block_tables.table[rows, 0].tolist() == [7, 8]
    assert batch.greedy[rows].tolist() == [True, False]
    params = batch.filter_params(rows, torch.float32, torch.device("cpu"), vocab=4)
    assert params.top_k.tolist() == [0, 4]  # clamped to the vocabulary
    # the same tensors the sampler makes from the Python floats
    assert torch.equal(params.temperature, torch.tensor([0.0, 0.7]))
    assert torch.equal(params.top_p, torch.tensor([1.0, 0.9])) and torch.equal(params.min_p, torch.tensor([0.0, 0.1]))

    # the worker samples a token for each (a decode step's: held, one per row of the plan), and the next
    # step of the same requests names no ids: the held tokens are appended when the rows are read
    batch.hold_sampled(torch.tensor([9, 10]))
    plan = update(batch, message([], None, [1, 1], [3, 2]))
    assert batch.held_tokens is not None and batch.num_tokens[rows].tolist() == [3, 2]
    assert [s.request.all_token_ids for s in plan] == [[1, 2, 3, 9], [4, 5, 10]]
    assert batch.held_tokens is None
    assert batch.token_ids[rows[0], :4].tolist() == [1, 2, 3, 9]
    assert batch.token_ids[rows[1], :3].tolist() == [4, 5, 10]
    # held again, then a plan with other rows: appended to the old plan's rows first
    batch.hold_sampled(torch.tensor([21, 22]))

    # "a" finishes; "c" (greedy but asking for logprobs: the sampler's row) takes its row, a third grows the batch
    plan = update(batch, message([NewRequestData("c", [6], with_logprobs), NewRequestData("d", [11, 12], greedy)],
                                ["b", "c", "d"], [1, 1, 2], [3, 0, 0], finished={"a"},
                                table_changes=[{"c": (0, [5]), "d": (0, [6])}]))
    assert set(batch.requests) == {"b", "c", "d"}
    assert batch.rows[1] == rows[0]
    assert batch.greedy[batch.rows].tolist() == [False, False, True]
    assert batch.token_ids[batch.rows[1], :1].tolist() == [6]
    assert batch.token_ids[batch.rows[2], :2].tolist() == [11, 12]
    assert batch.block_tables.table[batch.rows, 0].tolist() == [8, 5, 6]
    assert batch.all_greedy([batch.rows[2]]) and not batch.all_greedy(batch.rows)
    assert batch.token_ids[batch.rows[0], :4].tolist() == [4, 5, 10, 22] and batch.held_tokens is None
    batch.append_sampled([[], [15], [16]])  # any other step's, in the plan's order ("b" sampled nothing)

    # "b" ends and a new request reuses its id in a plan of the same ids (sent as None): the new one runs
    plan = update(batch, message([NewRequestData("b", [13, 14], greedy)], None, [2, 1, 1], [0, 1, 2],
                                finished={"b"}, table_changes=[{"b": (0, [9])}]))
    assert [s.request.all_token_ids for s in plan] == [[13, 14], [6, 15], [11, 12, 16]]
    assert batch.greedy[batch.rows].tolist() == [True, False, True]
    assert batch.block_tables.table[batch.rows, 0].tolist() == [9, 5, 6]


@pytest.mark.parametrize("engine_args", [
    pytest.param(dict(max_num_batched_tokens=7, max_num_seqs=3), id="chunked_budget7"),
    pytest.param(dict(num_gpu_blocks_override=12, block_size=4), id="preempting"),
    pytest.param(dict(speculative_model="[ngram]", num_speculative_tokens=3), id="ngram_spec"),
])
def test_decode_steps_gather_the_positions_the_plan_names(tiny_llama_dir: str, engine_args: dict) -> None:
    """A decode step's inputs come from the input batch's token rows and counts, not from the plan's start
    positions: every decode step of a run that chunks, preempts or speculates must find each request's
    last known token at the position the scheduler planned, and its id where the engine has it (the
    worker's rows, which it appends its sampled tokens to, hold the engine's tokens)."""
    from pagedllm import LLM
    from pagedllm.worker.model_runner import ModelRunner

    checked = []
    original = ModelRunner._prepare_plan

    def checking(self: ModelRunner, columns):  # type: ignore[no-untyped-def]
        batch = original(self, columns)
        if batch.decode:
            rows = self.input_batch.rows
            assert (self.input_batch.num_tokens[rows] - 1).tolist() == columns.start_pos
            assert batch.positions.tolist() == columns.start_pos
            assert batch.input_ids.tolist() == [s.request.all_token_ids[s.start_pos] for s in batch.order]
            # the worker appended the tokens it sampled itself: the engine's copies agree
            engine_requests = llm.llm_engine.scheduler.requests
            assert [s.request.all_token_ids for s in batch.order] == \
                [engine_requests[s.request.request_id].all_token_ids for s in batch.order]
            checked.append(len(rows))
        return batch

    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(6)]
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, **engine_args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelRunner, "_prepare_plan", checking)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [10] * 6
    assert checked, "the run had no decode step"
