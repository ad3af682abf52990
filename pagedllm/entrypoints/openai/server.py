"""The FastAPI app of the OpenAI-compatible server: routes, errors in OpenAI's shape, limits, auth.

No input takes the server down: every failure (a bad parameter, malformed JSON, an oversized body,
a wrong key, a full queue, a bug) becomes `{"error": {"message", "type", "param", "code"}}` with a
fitting status, and the engine keeps serving the other requests. A 5xx body is generic (a request
id to find the details in the log). Slow clients cannot hold the server: a request body must arrive
within --read-timeout, and a response write (an unread stream) may stall for at most --write-timeout
before the connection is closed and its requests aborted.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from pagedllm.entrypoints.openai.kv_cache_page import kv_cache_router
from pagedllm.entrypoints.openai.limits import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_TOKENIZE_TIMEOUT_S,
    DEFAULT_WRITE_TIMEOUT_S,
    PROMPT_CHARS_PER_TOKEN,
    TOKENIZER_WORKERS,
)
from pagedllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, messages_chars, render_chat_prompt
from pagedllm.entrypoints.openai.serving_completions import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import (
    APIError,
    ClientDisconnected,
    ServingContext,
    TokenizerPool,
    error_body,
    internal_error,
)
from pagedllm.entrypoints.openai.serving_lora import LoRARegistry, lora_router, parse_lora_modules
from pagedllm.metrics.reader import Gauge
from pagedllm.version import __version__

logger = logging.getLogger(__name__)

def default_served_model_name(model_path: str) -> str:
    """The name clients see for a model: its directory's or GGUF file's name, never a filesystem path."""
    name = os.path.basename(model_path.rstrip("/")) or model_path
    return name.removesuffix(".gguf")


@dataclass
class ServerConfig:
    """What the HTTP layer needs beyond the engine (from `pagedllm serve`'s flags)."""

    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompt_chars: int | None = None  # None: max_model_len x PROMPT_CHARS_PER_TOKEN
    trust_request_chat_template: bool = False
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S
    tokenize_timeout: float = DEFAULT_TOKENIZE_TIMEOUT_S
    log_requests: bool = False  # one INFO line per request (`pagedllm serve` turns it on)
    lora_modules: list[str] | None = None  # --lora-modules: NAME=PATH or JSON, served as models
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    tool_call_parser: str | None = None  # --enable-auto-tool-choice's --tool-call-parser (tool_choice "auto")
    return_tokens_as_token_ids: bool = False
    reasoning_parser: str | None = None  # --reasoning-parser
    response_role: str = "assistant"

    @classmethod
    def from_args(cls, args: argparse.Namespace | ServerConfig | None, model_path: str) -> ServerConfig:
        if isinstance(args, ServerConfig):
            return args
        # a client sees a name, never the server's filesystem
        names = getattr(args, "served_model_name", None) or [default_served_model_name(model_path)]
        if isinstance(names, str):
            names = [names]

        def arg(name: str, default: object) -> object:
            value = getattr(args, name, None)
            return default if value is None else value

        return cls(
            served_model_names=list(names), model_path=model_path,
            api_key=getattr(args, "api_key", None) or None,
            max_waiting_requests=arg("max_waiting_requests", DEFAULT_MAX_WAITING_REQUESTS) or None,
            max_request_body_bytes=getattr(args, "max_request_body_bytes", None)
            or DEFAULT_MAX_REQUEST_BODY_BYTES,
            max_prompt_chars=getattr(args, "max_prompt_chars", None),
            trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
            read_timeout=float(arg("read_timeout", DEFAULT_READ_TIMEOUT_S)),
            write_timeout=float(arg("write_timeout", DEFAULT_WRITE_TIMEOUT_S)),
            tokenize_timeout=float(arg("tokenize_timeout", DEFAULT_TOKENIZE_TIMEOUT_S)),
            log_requests=args is not None and not getattr(args, "disable_log_requests", False),
            lora_modules=getattr(args, "lora_modules", None),
            allow_runtime_lora_updating=bool(getattr(args, "allow_runtime_lora_updating", False)),
            tool_call_parser=getattr(args, "tool_call_parser", None)
            if getattr(args, "enable_auto_tool_choice", False) else None,
            return_tokens_as_token_ids=bool(getattr(args, "return_tokens_as_token_ids", False)),
            reasoning_parser=getattr(args, "reasoning_parser", None),
            response_role=getattr(args, "response_role", None) or "assistant",
        )


# scope["extensions"] key of a callable that drops the connection (set by our uvicorn protocol)
ABORT_CONNECTION = "pagedllm.abort_connection"


class StalledClient(Exception):
    """A response write waited longer than the write timeout: the client stopped reading."""


class ConnectionGuardMiddleware:
    """Keeps slow clients from holding the server: a write that stalls past `write_timeout` (a client
    that stopped reading its stream) ends the response, which aborts its engine requests, and the
    connection is closed. Also serves `/path/` as `/path` instead of a body-less 307 redirect.
    """

    def __init__(self, app: ASGIApp, write_timeout: float) -> None:
        self.app = app
        self.write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}

        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout)
            except asyncio.TimeoutError:
                raise StalledClient() from None

        try:
            await self.app(scope, receive, timed_send)
        except StalledClient:
            # drop the connection and whatever the client left unread; without the hook, returning
            # with the response unfinished makes uvicorn close it
            abort_connection = (scope.get("extensions") or {}).get(ABORT_CONNECTION)
            if abort_connection is not None:
                abort_connection()
                await asyncio.sleep(0)  # let uvicorn see the connection lost before this returns
            logger.info("closed a connection whose client did not read for %.0f s", self.write_timeout)


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over the limit, without reading more than limit + 1 bytes.

    A pure ASGI middleware (not BaseHTTPMiddleware) so that streaming responses and the disconnect
    messages the handlers listen for pass through untouched.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, read_timeout: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(scope, receive, send)
            return
        # read the body up front (API bodies are small) and replay it to the app
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout  # the whole body, so trickling bytes does not help
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                response = error_response(APIError(
                    408, f"The request body did not arrive within {self.read_timeout:g} s.", "RequestTimeout"))
                await response(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(APIError(
            413, f"Request body too large: the limit is {self.max_body_bytes} bytes.",
            "RequestEntityTooLarge"))
        await response(scope, receive, send)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status_code)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"Malformed JSON in the request body: {first.get('msg', '')}")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = location[0] if location else None
    where = ".".join(location)
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', '')}"
        for e in errors[:5]) or "invalid request"
    return APIError(400, f"Invalid request ({where or 'body'}): {message}", param=param)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                 405: "MethodNotAllowed", 413: "RequestEntityTooLarge"}
        return error_response(APIError(exc.status_code, str(exc.detail),
                                       kinds.get(exc.status_code, "HTTPError")))

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is left to read it (nginx's "client closed request")

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineStepError)
    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        # generic text and a request id; the exception itself goes to the log only
        return error_response(internal_error(exc))


def _default_sampling_params(engine: AsyncLLMEngine) -> dict[str, Any]:
    get_diff = getattr(engine.model_config, "get_diff_sampling_param", None)
    defaults = get_diff() if get_diff is not None else {}
    if defaults:
        logger.info("Default sampling parameters come from the model's generation config: %s "
                    "(explicit request fields win; --generation-config vllm turns this off)", defaults)
    return defaults


def build_app(engine: AsyncLLMEngine, args: argparse.Namespace | ServerConfig | None = None) -> FastAPI:
    """The server for `engine`; its lifespan starts taking the engine's outputs and stops the engine at exit."""
    model_path = str(getattr(engine.model_config, "model", "") or "")
    config = ServerConfig.from_args(args, model_path)
    metrics = ServerMetrics(config.served_model_names[0])
    engine.observers.append(metrics)
    # the event loop detokenizes with engine.tokenizer; the tokenizer threads get their own copies so
    # two threads never share one Rust tokenizer ("Already borrowed")
    try:
        tokenizer = copy.deepcopy(engine.tokenizer)
    except Exception:
        tokenizer = engine.tokenizer
    max_model_len = int(engine.model_config.max_model_len)
    context = ServingContext(engine=engine, tokenizer=tokenizer, served_model_names=config.served_model_names,
                             model_aliases=(config.model_path,) if config.model_path else (),
                             tool_call_parser=config.tool_call_parser,
                             return_tokens_as_token_ids=config.return_tokens_as_token_ids,
                             reasoning_parser=config.reasoning_parser, response_role=config.response_role,
                             max_model_len=max_model_len, max_waiting_requests=config.max_waiting_requests,
                             max_prompt_chars=config.max_prompt_chars or max_model_len * PROMPT_CHARS_PER_TOKEN,
                             trust_request_chat_template=config.trust_request_chat_template,
                             log_requests=config.log_requests,
                             default_sampling_params=_default_sampling_params(engine))
    lora_registry = LoRARegistry(engine, config.served_model_names)
    for module in parse_lora_modules(config.lora_modules):
        lora_registry.add(module.name, module.path, module.base_model_name)  # a bad one stops start-up
    context.lora_registry = lora_registry
    completions = OpenAIServingCompletion(context)
    chat = OpenAIServingChat(context)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if tokenizer is not None:  # made on the event loop it serves
            context.tokenizer_pool = TokenizerPool(tokenizer, TOKENIZER_WORKERS, config.tokenize_timeout)
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()  # aborts whatever the graceful period left running

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    app.state.metrics = metrics
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_request_body_bytes,
                       read_timeout=config.read_timeout)
    app.add_middleware(ConnectionGuardMiddleware, write_timeout=config.write_timeout)

    async def verify_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                     config.api_key.encode()):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                           "AuthenticationError")

    # open: liveness, version and metrics (scraped by monitoring without the key)
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(APIError(503, "The engine is not running.", "ServiceUnavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        engine_metrics = await engine.get_metrics()
        admission = [Gauge("pagedllm:server_waiting_sequences", context.num_waiting_sequences),
                     Gauge("pagedllm:server_waiting_sequences_peak", context.peak_waiting_sequences)]
        return Response(metrics.render(engine_metrics + admission), media_type=CONTENT_TYPE)

    api = APIRouter(dependencies=[Depends(verify_api_key)])

    @api.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, root=name, max_model_len=context.max_model_len)
            for name in config.served_model_names] + [
            # root: the adapter's name, not its path (a client never sees the server's filesystem)
            ModelCard(id=lora.lora_name, root=lora.lora_name, parent=lora.base_model_name,
                      max_model_len=context.max_model_len)
            for lora in lora_registry.adapters.values()])

    @api.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(body, raw_request)

    @api.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(body, raw_request)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        context.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of 'prompt' and 'messages'.", param="prompt")
        if body.messages is not None:
            messages = body.messages
            context.check_prompt_chars(messages_chars(messages), "messages")
            token_ids = await context.encode_chat(lambda tok: render_chat_prompt(
                tok, messages, body.add_generation_prompt, None, None, body.continue_final_message))
        else:
            token_ids = await context.encode_prompt(body.prompt, add_special_tokens=body.add_special_tokens)
        token_strs = tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=context.max_model_len,
                                tokens=token_ids, token_strs=token_strs)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        context.check_model(body.model)
        context.check_token_ids(body.tokens, "tokens")
        tokens = body.tokens
        return DetokenizeResponse(prompt=await context.run_tokenizer(lambda tok: tok.decode(tokens), "tokens"))

    app.include_router(api)
    app.include_router(lora_router(lora_registry, config.allow_runtime_lora_updating, verify_api_key))
    app.include_router(kv_cache_router(engine, verify_api_key, config.served_model_names[0]))
    return app
