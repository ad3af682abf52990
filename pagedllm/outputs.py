"""What the engine returns, with vLLM's names: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.lora.request import LoRARequest


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


def position_logprobs(token_id: int, logprob: float, rank: int, top_ids: list[int] = (),
                      top_logprobs: list[float] = ()) -> PositionLogprobs:
    """The chosen token with its rank, then the top-N by rank (the chosen one is not listed twice)."""
    entry: PositionLogprobs = {token_id: Logprob(logprob, rank)}
    for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs), start=1):
        entry.setdefault(top_id, Logprob(top_logprob, top_rank))
    return entry


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # Disaggregated prefill: where a decode instance pulls this request's KV blocks (vLLM's field).
    kv_transfer_params: dict | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran under (vLLM's field)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Fold a later output of the same request into this one (vLLM's RequestOutput.add): a reader
        that fell behind gets one output. `aggregate` (DELTA outputs) appends each completion's new
        text, tokens and logprobs; otherwise the later completion replaces the earlier one."""
        self.finished = self.finished or next_output.finished
        self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        self.kv_transfer_params = next_output.kv_transfer_params or self.kv_transfer_params
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        for completion in next_output.outputs:
            for position, mine in enumerate(self.outputs):
                if mine.index != completion.index:
                    continue
                if aggregate:
                    mine.text += completion.text
                    # a DELTA output's lists are its own slices, so extending them in place is safe
                    mine.token_ids.extend(completion.token_ids)
                    if completion.logprobs is not None:
                        if mine.logprobs is None:
                            mine.logprobs = []
                        mine.logprobs.extend(completion.logprobs)
                    mine.cumulative_logprob = completion.cumulative_logprob
                    mine.finish_reason = completion.finish_reason
                    mine.stop_reason = completion.stop_reason
                else:
                    self.outputs[position] = completion
                break
            else:
                self.outputs.append(completion)
