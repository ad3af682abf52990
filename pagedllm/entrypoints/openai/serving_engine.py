"""What both OpenAI endpoints share: the per-request ServingContext, OpenAI-shaped errors (APIError),
server-sent events, disconnect handling and logprob helpers.

One request never harms another: everything a client sends is checked here or by the engine before
it reaches a step; tokenization and chat templates run on worker threads with a time limit, and the
model runs in the engine core's own process, so the event loop (and /health) stays responsive;
admission counts sequences atomically; a 5xx body says only "internal server error" and a request id,
and the details go to the log.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    OutputQueue,
    RequestStream,
)
from pagedllm.engine.input_processor import truncate_prompt
from pagedllm.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs, SamplingRequestFields
from pagedllm.lora.request import LoRARequest
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


class ClientDisconnected(Exception):
    """The client hung up before its answer was ready; its requests were aborted. Nothing to send."""


def internal_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """The answer to a failure that is not the client's: a generic message and a request id to find
    the details in the log (which gets them here), never the exception's text."""
    request_id = request_id or f"req-{uuid.uuid4().hex}"
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The server is shutting down or its engine stopped; retry later "
                        f"(request id {request_id}).", "ServiceUnavailable")
    if not isinstance(exc, EngineStepError):  # the engine already logged the step's exception
        logger.error("request %s failed", request_id, exc_info=exc)
    return APIError(500, f"internal server error (request id {request_id})", "InternalServerError")


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

    num_tokens: int = 0
    text_offset: int = 0
    echoed: bool = False
    finished: bool = False


class TokenizerPool:
    """Tokenization and chat-template rendering on worker threads, off the event loop.

    Each job runs on its own daemon thread (a runaway template cannot keep the process alive at
    exit) with one of `size` tokenizer copies (two threads never share a Rust tokenizer: "Already
    borrowed"); the caller waits at most `timeout` seconds for a copy and for the result.
    """

    def __init__(self, tokenizer: Any, size: int, timeout: float) -> None:
        self.timeout = timeout
        self._free: asyncio.Queue[Any] = asyncio.Queue()
        for index in range(size):
            try:
                self._free.put_nowait(tokenizer if index == 0 else copy.deepcopy(tokenizer))
            except Exception:  # a tokenizer that cannot be copied is shared by a single worker
                break

    async def run(self, fn: Callable[[Any], Any], param: str) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            tokenizer = await asyncio.wait_for(self._free.get(), self.timeout)
        except asyncio.TimeoutError:
            raise APIError(503, "The server is busy tokenizing other requests; retry later.") from None
        result: asyncio.Future[Any] = loop.create_future()

        def work() -> None:
            try:
                value, error = fn(tokenizer), None
            except BaseException as exc:  # handed to the waiter, which decides what the client sees
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, result, value, error)
                loop.call_soon_threadsafe(self._free.put_nowait, tokenizer)  # only once it is idle
            except RuntimeError:
                pass  # the event loop is closed

        threading.Thread(target=work, name="pagedllm-tokenize", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(result), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise APIError(400, f"Preparing the prompt took longer than {self.timeout:g} s; send a shorter "
                           "prompt.", param=param) from None


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    tokenizer: Any
    served_model_names: list[str]
    max_model_len: int
    # other names a request's `model` may give for the first served name: the model path as `serve` was
    # given it (vLLM's default served name), though /v1/models lists the name only
    model_aliases: tuple[str, ...] = ()
    # sequences (prompts x n) admitted but not yet started; None: unbounded
    max_waiting_requests: int | None = None
    max_prompt_chars: int | None = None
    trust_request_chat_template: bool = False
    tokenizer_pool: TokenizerPool | None = None
    log_requests: bool = False
    # SamplingParams fields from the model's generation config ({} with --generation-config vllm)
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    # LoRA adapters a request's `model` may name (serving_lora.LoRARegistry; None: LoRA off)
    lora_registry: Any = None
    # tool_choice "auto": the parser that reads the model's calls from its text (None: "auto" is a 400)
    tool_call_parser: str | None = None
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N" unless a request says
    reasoning_parser: str | None = None  # --reasoning-parser: <think> text as reasoning_content
    response_role: str = "assistant"  # the role chat replies carry (--response-role)
    vocab_size: int = field(init=False)
    num_waiting_sequences: int = field(init=False, default=0)
    peak_waiting_sequences: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        # the model's vocabulary, which the engine checks token ids against (may exceed the tokenizer's)
        self.vocab_size = int(getattr(self.engine.model_config, "vocab_size", 0) or len(self.tokenizer))

    # ---- checks at the boundary -----------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; 404 for a name this server does not serve."""
        if name is None or name == "" or name in self.model_aliases:
            return self.served_model_names[0]
        if name not in self.served_model_names and self.lora_request_for(name) is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")
        return name

    def tokens_as_ids(self, request: SamplingRequestFields) -> bool:
        """Whether the request's logprobs name their tokens "token_id:N" (vLLM's option)."""
        asked = request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def lora_request_for(self, model_name: str) -> LoRARequest | None:
        """The adapter a `model` name selects (None: the base model)."""
        return self.lora_registry.get(model_name) if self.lora_registry is not None else None

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise APIError(400, f"{param} contains token id {token_id}, outside the vocabulary "
                               f"[0, {self.vocab_size}).", param=param)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse text too long to fit the context before paying for its tokenization."""
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise APIError(400, f"The {param} is {num_chars} characters long, more than this server "
                           f"accepts ({limit}, --max-prompt-chars).", param=param)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                     max_tokens_param: str = "max_tokens") -> int:
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
                           f"Please reduce the length of the input or of {max_tokens_param}.",
                           param=max_tokens_param)
        return max_tokens

    def truncate(self, token_ids: list[int], request: SamplingRequestFields) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (vLLM's; -1: the context's length less one, so one
        token can be generated)."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == 0:
            raise APIError(400, "truncate_prompt_tokens must be at least 1 (or -1: the context's length).",
                           param="truncate_prompt_tokens")
        return truncate_prompt(token_ids, keep, self.max_model_len)

    def check_num_sequences(self, num_sequences: int, param: str) -> None:
        limit = self.max_waiting_requests
        if limit is not None and num_sequences > limit:  # a 503 would invite endless retries
            raise APIError(400, f"This request asks for {num_sequences} sequences (prompts x n), more "
                           f"than this server admits at once ({limit}, --max-waiting-requests).",
                           param=param)

    def admit(self, num_sequences: int, param: str, sequences_per_prompt: int = 1) -> _Admission:
        """Count the request's sequences as waiting, or refuse it; no await in between, so a burst of
        concurrent requests can never overshoot the limit."""
        if not self.engine.is_running:
            raise APIError(503, "The engine is not running.")
        self.check_num_sequences(num_sequences, param)
        limit = self.max_waiting_requests
        if limit is not None:
            if self.num_waiting_sequences + num_sequences > limit:
                raise APIError(503, f"The server is busy: {self.num_waiting_sequences} sequences are "
                               f"waiting (limit {limit}). Retry later.")
        self.num_waiting_sequences += num_sequences
        self.peak_waiting_sequences = max(self.peak_waiting_sequences, self.num_waiting_sequences)
        return _Admission(self, num_sequences, sequences_per_prompt)

    # ---- tokenization, done here so lengths are checked before the engine sees the request -------

    async def encode_prompt(self, text: str, param: str = "prompt",
                            add_special_tokens: bool = True) -> list[int]:
        self.check_prompt_chars(len(text), param)
        return await self.run_tokenizer(
            lambda tokenizer: list(tokenizer.encode(text, add_special_tokens=add_special_tokens)), param)

    async def encode_chat(self, render: Callable[[Any], str], param: str = "messages") -> list[int]:
        """Render the chat template (a function of the tokenizer) and tokenize its text."""
        def work(tokenizer: Any) -> list[int]:
            text = render(tokenizer)
            self.check_prompt_chars(len(text), param)
            # the chat template already wrote the special tokens (BOS) it wants
            return list(tokenizer.encode(text, add_special_tokens=False))

        return await self.run_tokenizer(work, param)

    async def run_tokenizer(self, fn: Callable[[Any], Any], param: str) -> Any:
        if self.tokenizer_pool is None:
            return fn(self.tokenizer)
        return await self.tokenizer_pool.run(fn, param)

    def build_params(self, request: SamplingRequestFields, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None = None,
                     renames: dict[str, str] | None = None) -> SamplingParams:
        if request.use_beam_search:
            raise APIError(400, "use_beam_search: beam search is not supported; sample n sequences instead.",
                           param="use_beam_search")
        if request.priority:
            raise APIError(400, "priority: requests run first come first served here; there is no priority "
                           "scheduling.", param="priority")
        if request.prompt_logprobs is not None:
            if getattr(request, "stream", False):  # (as vLLM: they come whole, with the final response)
                raise APIError(400, "prompt_logprobs is not available with stream=true.", param="prompt_logprobs")
            prompt_logprobs = max(request.prompt_logprobs, prompt_logprobs or 0)
        try:
            return request.build_sampling_params(max_tokens, logprobs, prompt_logprobs,
                                                 self.default_sampling_params)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param_of(str(exc), set(type(request).model_fields),
                                                         renames)) from exc

    # ---- engine requests --------------------------------------------------------------------------

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     request: SamplingRequestFields, renames: dict[str, str] | None = None,
                     lora_request: LoRARequest | None = None) -> tuple[list[RequestStream], OutputQueue]:
        """One engine request per prompt, all feeding one queue; 400 if the engine refuses one."""
        admission = self.admit(len(prompts) * params.n, "n" if params.n > 1 else "prompt", params.n)
        if self.log_requests:
            logger.info("Received request %s: %s prompt tokens, params: %s", request_id,
                        "+".join(str(len(prompt)) for prompt in prompts), params)
        queue = OutputQueue()
        arrival_time = time.time()
        # all prompts go to the engine in one iteration, so they start together
        tasks = [asyncio.ensure_future(self.engine.add_request(
            f"{request_id}-{index}" if len(prompts) > 1 else request_id, prompt, params,
            arrival_time=arrival_time, queue=queue, on_started=admission.started_one, lora_request=lora_request))
            for index, prompt in enumerate(prompts)]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away: abort what was accepted already
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().abort()
                else:
                    task.cancel()  # add_request aborts its own request when cancelled
            admission.release()
            raise
        streams = [result for result in results if isinstance(result, RequestStream)]
        errors = [result for result in results if isinstance(result, BaseException)]
        if not errors:
            return streams, queue
        abort_all(streams)  # one refused prompt refuses the whole request
        admission.release()
        error = errors[0]
        if isinstance(error, ValueError):
            raise APIError(400, str(error), param=param_of(str(error), set(type(request).model_fields),
                                                           renames)) from error
        raise internal_error(error, request_id) from error


class _Admission:
    """One request's sequences counted as waiting, until each prompt's request starts (or ends)."""

    def __init__(self, context: ServingContext, num_sequences: int, sequences_per_prompt: int) -> None:
        self.context = context
        self.num_sequences = num_sequences
        self.sequences_per_prompt = sequences_per_prompt

    def started_one(self) -> None:
        """A prompt's stream stopped waiting (each stream calls this once)."""
        self._take(self.sequences_per_prompt)

    def release(self) -> None:
        self._take(self.num_sequences)

    def _take(self, count: int) -> None:
        count = min(count, self.num_sequences)
        self.num_sequences -= count
        self.context.num_waiting_sequences -= count


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def merged_outputs(streams: list[RequestStream], queue: OutputQueue,
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) until every stream finished.

    The queue folds the undelivered outputs of each request into one (OutputQueue), so a reader that
    falls behind gets what it missed in one piece instead of replaying every step.
    """
    index_of = {stream.request_id: index for index, stream in enumerate(streams)}
    remaining = len(streams)
    while remaining:
        for request_id, item in await queue.get_batch():
            if isinstance(item, BaseException):
                raise item
            yield index_of[request_id], item
            if item.finished:
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
        # an ordinary event, not an error: answered with nothing and no traceback in the log
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()


def stream_response(events: Callable[[], AsyncIterator[str]]) -> StreamingResponse:
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stream_error_event(exc: BaseException, request_id: str) -> str:
    error = exc if isinstance(exc, APIError) else internal_error(exc, request_id)
    return sse(error_body(error))


def finite(logprob: float) -> float:
    """JSON has no -inf: a token the sampler ruled out gets vLLM's stand-in, -9999."""
    return max(float(logprob), -9999.0)


def decoded(tokenizer: Any, token_id: int, logprob: Any, as_id: bool = False) -> str:
    """A logprob's token as text (as_id: "token_id:N", vLLM's return_tokens_as_token_ids)."""
    if as_id:
        return f"token_id:{token_id}"
    text = getattr(logprob, "decoded_token", None)
    return text if text is not None else tokenizer.decode([token_id])


def prompt_logprobs_json(tokenizer: Any, prompt_logprobs: list[dict[int, Any] | None] | None
                         ) -> PromptLogprobs | None:
    """A RequestOutput's prompt_logprobs as vLLM's server returns them (-inf as -9999)."""
    if prompt_logprobs is None:
        return None
    return [None if step is None else {
        str(token_id): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                     decoded_token=decoded(tokenizer, token_id, lp))
        for token_id, lp in step.items()} for step in prompt_logprobs]


def logprob_rank(logprob: Any) -> int:
    """Sort key for a position's logprobs: by rank, entries without one last."""
    rank = getattr(logprob, "rank", None)
    return rank if rank is not None else 1 << 30
