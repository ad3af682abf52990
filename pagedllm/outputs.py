"""What the engine returns, with vLLM's names: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


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
