"""The scheduler's plan as columns (SchedulerOutput), driven directly: no model runs."""

from __future__ import annotations

from pagedllm import SamplingParams
from pagedllm.config import SchedulerConfig
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv_cache.manager import KVCacheManager


def scheduler(budget: int) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64, num_speculative_tokens=16)
    return Scheduler(config, KVCacheManager(num_blocks=64, block_size=4, enable_caching=False))


def run(sched: Scheduler, sampled: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    plan = sched.schedule()
    sched.update(plan, ModelRunnerOutput(sampled_token_ids=[
        sampled[request.request_id] if sample else []
        for request, sample in zip(plan.requests, plan.sample or [True] * len(plan.requests))]))
    return plan


def test_a_prompt_cut_by_the_budget_samples_nothing_and_the_columns_say_so() -> None:
    sched = scheduler(budget=8)
    short, long = (Request(name, list(range(1, n + 1)), SamplingParams(max_tokens=5)) for name, n in
                   (("short", 3), ("long", 12)))
    sched.add_request(short)
    sched.add_request(long)
    plan = run(sched, {"short": [50]})
    assert [r.request_id for r in plan.requests] == ["short", "long"]
    assert (plan.num_new_tokens, plan.start_pos, plan.sample, plan.spec_token_ids) == ([3, 5], [0, 0], [True, False],
                                                                                        None)
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in plan.scheduled] == \
        [("short", 3, True), ("long", 5, False)]
    plan = run(sched, {"short": [51], "long": [60]})  # the decode first, then the rest of the prompt
    assert (plan.num_new_tokens, plan.start_pos, plan.sample) == ([1, 7], [3, 5], None)
    assert short.output_token_ids == [50, 51] and long.output_token_ids == [60]


def test_proposals_cut_by_the_budget_are_dropped_and_the_request_still_samples() -> None:
    sched = scheduler(budget=8)
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20))
    sched.add_request(request)
    run(sched, {"r": [7]})
    sched.update_draft_token_ids({"r": list(range(100, 112))})  # 12 proposals: 13 tokens, past the budget
    plan = run(sched, {"r": [8]})
    # only the known token is computed, and it samples (with no proposals to verify)
    assert (plan.num_new_tokens, plan.start_pos, plan.sample, plan.spec_token_ids) == ([1], [5], None, None)
    assert request.spec_token_ids == [] and request.output_token_ids == [7, 8]
    sched.update_draft_token_ids({"r": [100, 101]})  # these fit: verified with the known token
    plan = run(sched, {"r": [100, 9]})
    assert (plan.num_new_tokens, plan.sample, plan.spec_token_ids) == ([3], None, [[100, 101]])
    assert request.output_token_ids == [7, 8, 100, 9] and request.num_computed_tokens == 8
