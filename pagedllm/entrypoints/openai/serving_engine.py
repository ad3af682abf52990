"""What both OpenAI endpoints share: the per-request ServingContext, OpenAI-shaped errors (APIError),
server-sent events, disconnect handling and logprob helpers."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    SamplingRequestFields,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestEntityTooLarge", 500: "InternalServerError", 503: "ServiceUnavailable"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status_code: int, message: str, error_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type or _ERROR_TYPES.get(status_code, "Error")
        self.param = param


def error_body(error: APIError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param,
                      "code": error.status_code}}


def sse(payload: Any) -> str:
    """One server-sent event; the OpenAI clients read `data: <json>` blocks."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"

_LEADING_NAME = re.compile(r"\s*'?([A-Za-z_][A-Za-z0-9_]*)")


def param_of(message: str, known: set[str], renames: dict[str, str] | None = None) -> str | None:
    """The request field an engine ValueError is about: its message starts with the field's name."""
    match = _LEADING_NAME.match(message)
    if match is None:
        return None
    name = (renames or {}).get(match.group(1), match.group(1))
    return name if name in known else None


@dataclass
class ChoiceState:
    """What a stream already sent for one choice."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    echoed: bool = False
    finished: bool = False


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    tokenizer: Any
    served_model_names: list[str]
    max_model_len: int
    max_waiting_requests: int | None = None
    log_requests: bool = False
    # SamplingParams fields from the model's generation config ({} with --generation-config vllm)
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        # the model's vocabulary, which the engine checks token ids against (may exceed the tokenizer's)
        self.vocab_size = int(getattr(self.engine.model_config, "vocab_size", 0) or len(self.tokenizer))

    # ---- checks at the boundary -----------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; 404 for a name this server does not serve."""
        if name is None or name == "":
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")
        return name

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise APIError(400, f"{param} contains token id {token_id}, outside the vocabulary "
                               f"[0, {self.vocab_size}).", param=param)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> int:
        """The max_tokens to use; 400 if the prompt, or prompt plus max_tokens, exceeds the context."""
        if num_prompt_tokens >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                           f"However, your request has {num_prompt_tokens} input tokens. Please reduce "
                           "the length of the input.", param=prompt_param)
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:  # the rest of the context, unless the generation config bounds it (vLLM)
            return min(room, self.default_sampling_params.get("max_tokens") or room)
        if max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                           f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                           f"({num_prompt_tokens} in the input, {max_tokens} in the completion). "
                           "Please reduce the length of the input or of max_tokens.", param="max_tokens")
        return max_tokens

    def admit(self, num_requests: int) -> None:
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_waiting_requests + num_requests > limit:
            raise APIError(503, f"The server is busy: {self.engine.num_waiting_requests} requests are "
                           f"waiting (limit {limit}). Retry later.")
        if not self.engine.is_running:
            raise APIError(503, "The engine is not running.")

    # ---- tokenization, done here so lengths are checked before the engine sees the request -------

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(self, text: str) -> list[int]:
        # the chat template already wrote the special tokens (BOS) it wants
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def build_params(self, request: SamplingRequestFields, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None = None,
                     renames: dict[str, str] | None = None) -> SamplingParams:
        try:
            return request.build_sampling_params(max_tokens, logprobs, prompt_logprobs,
                                                 self.default_sampling_params)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param_of(str(exc), set(type(request).model_fields),
                                                         renames)) from exc

    # ---- engine requests --------------------------------------------------------------------------

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     request: SamplingRequestFields, renames: dict[str, str] | None = None,
                     ) -> tuple[list[RequestStream], asyncio.Queue[Any]]:
        """One engine request per prompt, all feeding one queue; 400 if the engine refuses one."""
        self.admit(len(prompts))
        if self.log_requests:
            logger.info("Received request %s: %s prompt tokens, params: %s", request_id,
                        "+".join(str(len(prompt)) for prompt in prompts), params)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        arrival_time = time.time()
        # all prompts go to the engine in one iteration, so they start together
        tasks = [asyncio.ensure_future(self.engine.add_request(
            f"{request_id}-{index}" if len(prompts) > 1 else request_id, prompt, params,
            arrival_time=arrival_time, queue=queue)) for index, prompt in enumerate(prompts)]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away: abort what was accepted already
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().abort()
                else:
                    task.cancel()  # add_request aborts its own request when cancelled
            raise
        streams = [result for result in results if isinstance(result, RequestStream)]
        errors = [result for result in results if isinstance(result, BaseException)]
        if not errors:
            return streams, queue
        abort_all(streams)  # one refused prompt refuses the whole request
        error = errors[0]
        if isinstance(error, ValueError):
            raise APIError(400, str(error), param=param_of(str(error), set(type(request).model_fields),
                                                           renames)) from error
        if isinstance(error, EngineDeadError):
            raise APIError(503, "The engine is not running.") from error
        raise error


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def merged_outputs(streams: list[RequestStream], queue: asyncio.Queue[Any],
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) until every stream finished.

    Outputs are cumulative, so when a reader falls behind only the newest output of each request
    matters: whatever piled up in the queue is coalesced instead of replayed one by one.
    """
    index_of = {stream.request_id: index for index, stream in enumerate(streams)}
    remaining = len(streams)
    while remaining:
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        latest: dict[str, RequestOutput] = {}
        for request_id, item in batch:
            if isinstance(item, BaseException):
                raise item
            latest[request_id] = item
        for request_id, output in latest.items():
            yield index_of[request_id], output
            if output.finished:
                remaining -= 1


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Run work, cancelling it if the client hangs up first (so its requests get aborted)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        work_task.cancel()
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()


def stream_response(events: Callable[[], AsyncIterator[str]]) -> StreamingResponse:
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stream_error_event(exc: BaseException) -> str:
    error = exc if isinstance(exc, APIError) else APIError(
        500 if not isinstance(exc, EngineDeadError) else 503, f"{type(exc).__name__}: {exc}")
    return sse(error_body(error))


def finite(logprob: float) -> float:
    """JSON has no -inf: a token the sampler ruled out gets vLLM's stand-in, -9999."""
    return max(float(logprob), -9999.0)


def decoded(tokenizer: Any, token_id: int, logprob: Any) -> str:
    text = getattr(logprob, "decoded_token", None)
    return text if text is not None else tokenizer.decode([token_id])


def logprob_rank(logprob: Any) -> int:
    """Sort key for a position's logprobs: by rank, entries without one last."""
    rank = getattr(logprob, "rank", None)
    return rank if rank is not None else 1 << 30
