"""The FastAPI app of the OpenAI-compatible server: routes, errors in OpenAI's shape, limits, auth.

No input takes the server down: every failure (a bad parameter, malformed JSON, an oversized body,
a wrong key, a full queue, a bug) becomes `{"error": {"message", "type", "param", "code"}}` with a
fitting status, and the engine keeps serving the other requests.
"""

from __future__ import annotations

import argparse
import copy
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.kv_cache_page import kv_cache_router
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
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, render_chat_prompt
from pagedllm.entrypoints.openai.serving_completions import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import APIError, ServingContext, error_body
from pagedllm.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class ServerConfig:
    """What the HTTP layer needs beyond the engine (from `pagedllm serve`'s flags)."""

    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES

    @classmethod
    def from_args(cls, args: argparse.Namespace | ServerConfig | None, model_path: str) -> ServerConfig:
        if isinstance(args, ServerConfig):
            return args
        names = getattr(args, "served_model_name", None) or [model_path]
        if isinstance(names, str):
            names = [names]
        return cls(
            served_model_names=list(names), model_path=model_path,
            api_key=getattr(args, "api_key", None) or None,
            max_waiting_requests=getattr(args, "max_waiting_requests", None),
            max_request_body_bytes=getattr(args, "max_request_body_bytes", None)
            or DEFAULT_MAX_REQUEST_BODY_BYTES,
        )


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over the limit, without reading more than limit + 1 bytes.

    A pure ASGI middleware (not BaseHTTPMiddleware) so that streaming responses and the disconnect
    messages the handlers listen for pass through untouched.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

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
        while True:
            message = await receive()
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

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        return error_response(APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                                       "InternalServerError"))


def build_app(engine: AsyncLLMEngine, args: argparse.Namespace | ServerConfig | None = None) -> FastAPI:
    """The server for `engine`; its lifespan starts the engine thread and shuts it down at exit."""
    model_path = str(getattr(engine.model_config, "model", "") or "")
    config = ServerConfig.from_args(args, model_path)
    metrics = ServerMetrics(config.served_model_names[0])
    engine.observers.append(metrics)
    # the engine thread detokenizes with engine.tokenizer; the HTTP side gets its own copy so two
    # threads never share one Rust tokenizer ("Already borrowed")
    try:
        tokenizer = copy.deepcopy(engine.tokenizer)
    except Exception:
        tokenizer = engine.tokenizer
    context = ServingContext(engine=engine, tokenizer=tokenizer, served_model_names=config.served_model_names,
                             max_model_len=int(engine.model_config.max_model_len),
                             max_waiting_requests=config.max_waiting_requests)
    completions = OpenAIServingCompletion(context)
    chat = OpenAIServingChat(context)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
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
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_request_body_bytes)

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
        return Response(metrics.render(engine_metrics), media_type=CONTENT_TYPE)

    api = APIRouter(dependencies=[Depends(verify_api_key)])

    @api.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, root=config.model_path, max_model_len=context.max_model_len)
            for name in config.served_model_names])

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
            text = render_chat_prompt(tokenizer, body.messages, body.add_generation_prompt, None)
            token_ids = context.encode_chat(text)
        else:
            token_ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        token_strs = tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=context.max_model_len,
                                tokens=token_ids, token_strs=token_strs)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        context.check_model(body.model)
        context.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    app.include_router(api)
    app.include_router(kv_cache_router(engine, verify_api_key, config.served_model_names[0]))
    return app
