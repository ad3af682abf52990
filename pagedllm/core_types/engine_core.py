"""The engine core's messages: requests in (token ids and resolved SamplingParams), per-sample deltas
out. The same objects cross the ZeroMQ boundary when the core runs in its own process."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PositionLogprobs, RequestMetrics
from pagedllm.sampling_params import SamplingParams


def _compact_reduce(self):  # type: ignore[no-untyped-def]
    # Pickled as (class, field values): the class reference is memoised once per message, so each
    # further object costs its values only, not its field names.
    return self.__class__, tuple(getattr(self, f.name) for f in fields(self))


@dataclass
class EngineCoreRequest:
    """A request as the core takes it: token ids and resolved SamplingParams (max_tokens set,
    all_stop_token_ids filled). The prompt text stays in the API process."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None = None

    __reduce__ = _compact_reduce


@dataclass
class EngineCoreOutput:
    """What one sample gained in one step. `request_id` is the user request's; `index` the sample's
    (parallel sampling, n > 1). Token ids and logprobs are the new ones only."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # the prompt's logprobs (complete once the first token is sampled): in a sample's first output only
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # the core's timings: in a sample's first and last output only
    metrics: RequestMetrics | None = None
    # disaggregated prefill: where a decode instance pulls this request's KV blocks (last output only)
    kv_transfer_params: dict | None = None

    __reduce__ = _compact_reduce

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def engine_request_id(request_id: str, index: int, n: int) -> str:
    """The scheduler's id of sample `index`: the request's own id, or one per sample when n > 1."""
    return f"{index}_{request_id}" if n > 1 else request_id


@dataclass
class EngineCoreOutputs:
    """Everything one core iteration sends back."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # user requests a failing step ended alone (the others carry on); their exceptions go to the log
    failed_request_ids: list[str] = field(default_factory=list)
    # the scheduler's waiting queue after the iteration (what --max-waiting-requests is about)
    num_waiting: int = 0

    __reduce__ = _compact_reduce


def merge_core_outputs(steps: list[EngineCoreOutputs]) -> EngineCoreOutputs:
    """Several consecutive steps' outputs as one: per sample, the new tokens and logprobs in order and
    the latest state (what the API process needs when it catches up on a backlog)."""
    if len(steps) == 1:
        return steps[0]
    merged: dict[tuple[str, int], EngineCoreOutput] = {}
    failed: list[str] = []
    for step in steps:
        failed += step.failed_request_ids
        for output in step.outputs:
            key = (output.request_id, output.index)
            previous = merged.get(key)
            if previous is None:
                merged[key] = output
                continue
            previous.new_token_ids = previous.new_token_ids + output.new_token_ids
            if output.new_logprobs is not None:
                previous.new_logprobs = (previous.new_logprobs or []) + output.new_logprobs
            previous.cumulative_logprob = output.cumulative_logprob
            previous.finish_reason = output.finish_reason
            previous.stop_reason = output.stop_reason
            previous.num_cached_tokens = output.num_cached_tokens
            previous.prompt_logprobs = previous.prompt_logprobs or output.prompt_logprobs
            previous.metrics = output.metrics or previous.metrics
            previous.kv_transfer_params = output.kv_transfer_params or previous.kv_transfer_params
    return EngineCoreOutputs(list(merged.values()), failed, steps[-1].num_waiting)
