"""`pagedllm serve [MODEL]`: the OpenAI-compatible server on uvicorn.

Every engine argument of `LLM` is a flag spelled as in vLLM (EngineArgs.add_cli_args). With no model
it serves the bundled demo model. It listens on loopback unless told otherwise.

Shutdown on SIGTERM or Ctrl-C: uvicorn stops accepting connections and lets in-flight requests run
for --timeout-graceful-shutdown seconds; then the engine ends what is left, each handler answers
503 (a stream: an error event and [DONE]), the engine core process stops, and the process exits 0.
If the engine core process dies instead, requests in flight get errors, /health answers 503, and the
process exits 1 (uvicorn_server.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Any

from pagedllm import envs
from pagedllm.assets import installed_model_path
from pagedllm.entrypoints import port_number
from pagedllm.entrypoints.openai.limits import (
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_TOKENIZE_TIMEOUT_S,
    DEFAULT_WRITE_TIMEOUT_S,
    PROMPT_CHARS_PER_TOKEN,
)
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing the server is an explicit choice (--host 0.0.0.0)
DEFAULT_PORT = 8000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import EngineArgs

    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, ...).",
)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="local Hugging Face-format model directory or .gguf file (default: "
                             "SmolLM2-135M-Instruct, fetched once; offline, the bundled demo model)")
    parser.add_argument("--model", dest="model", default=None,
                        help="the model directory, as a flag (vLLM's older spelling of MODEL)")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--api-key", default=envs.value("PAGEDLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the API (default: "
                             "$PAGEDLLM_API_KEY, else open)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model directory's name, or the .gguf "
                             "file's name without the extension)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="sequences (prompts x n) that may wait for their first token; beyond it "
                             "answer 503, and 400 to a request larger than the limit (0: unbounded)")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024,
                        help="answer 413 to bodies larger than this")
    parser.add_argument("--max-prompt-chars", type=int, default=None,
                        help="answer 400 to a prompt longer than this many characters, before "
                             f"tokenizing it (default: {PROMPT_CHARS_PER_TOKEN} x max_model_len)")
    parser.add_argument("--chat-template", default=None,
                        help="the chat template for chat requests instead of the model's: a Jinja file, or the "
                             "template itself")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto" (the default with tools): the model decides whether to call a '
                             "tool, and --tool-call-parser reads its calls from its text")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the format the model writes its tool calls in (hermes: Hermes, Qwen 2.5 and 3)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="a thinking model's <think> text comes back as reasoning_content (deepseek_r1: "
                             "the reply starts thinking; qwen3: only where it opens <think>)")
    parser.add_argument("--response-role", default="assistant", help="the role chat replies carry")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='logprobs name their tokens "token_id:N" (a request\'s return_tokens_as_token_ids '
                             "overrides it)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat templates sent in requests (chat_template, "
                             "chat_template_kwargs.chat_template); they run arbitrary Jinja")
    parser.add_argument("--tokenize-timeout", type=float, default=DEFAULT_TOKENIZE_TIMEOUT_S,
                        help="seconds a prompt may take to render and tokenize before a 400")
    parser.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="seconds a client has to send a request's headers, and its body")
    parser.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S,
                        help="seconds a response may wait on a client that does not read it; then the "
                             "connection is closed and its requests aborted")
    parser.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open")
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGTERM; then they are "
                             "answered 503 (streams: an error event and [DONE])")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log each request (its id, prompt length and sampling parameters)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="do not log throughput, running/waiting requests and KV usage every 5 s")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters served as models (needs --enable-lora): NAME=PATH, or JSON "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "($VLLM_ALLOW_RUNTIME_LORA_UPDATING=true too, as vLLM)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run_server)
    return parser


def resolve_model(args: argparse.Namespace) -> str | None:
    tag, flag = args.model_tag, getattr(args, "model", None)
    if tag and flag and tag != flag:
        raise ValueError(f"two models given: {tag!r} (positional) and --model {flag!r}; give one.")
    model = tag or flag
    if model:
        return str(model)
    return installed_model_path()


def run_server(args: argparse.Namespace) -> int:
    # a SIGTERM while the model loads has nothing in flight to wait for: just exit 0
    signal.signal(signal.SIGTERM, _exit_now)
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.uvicorn_server import bind_socket

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = resolve_model(args)
    if model is None:
        print("pagedllm serve: no model given and no default model is available; "
              "pass a model directory: pagedllm serve PATH", file=sys.stderr)
        return 2
    if not args.served_model_name:
        from pagedllm.entrypoints.openai.server import default_served_model_name

        args.served_model_name = [default_served_model_name(model)]  # "pycode-target", not a path
    args.model = model
    for flag, low in (("max_waiting_requests", 0), ("max_prompt_chars", 1), ("read_timeout", 1e-3),
                      ("write_timeout", 1e-3), ("tokenize_timeout", 1e-3), ("timeout_keep_alive", 0)):
        value = getattr(args, flag)
        if value is not None and value < low:
            print(f"pagedllm serve: --{flag.replace('_', '-')} must be "
                  f"{'>= 0' if low == 0 else 'positive'}", file=sys.stderr)
            return 2
    if envs.value("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):  # (vLLM's switch for it)
        args.allow_runtime_lora_updating = True
    if args.lora_modules or args.allow_runtime_lora_updating:
        from pagedllm.entrypoints.openai.serving_lora import parse_lora_modules

        if not args.enable_lora:
            print("pagedllm serve: --lora-modules and --allow-runtime-lora-updating need --enable-lora",
                  file=sys.stderr)
            return 2
        try:
            parse_lora_modules(args.lora_modules)
        except ValueError as error:
            print(f"pagedllm serve: {error}", file=sys.stderr)
            return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes its "
                         f"calls in: {', '.join(TOOL_CALL_PARSERS)}).")
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = model
    if engine_args.node_rank > 0:
        from pagedllm.engine.llm_engine import run_worker_node

        # Not node 0: no engine and no HTTP; host this node's ranks until node 0 shuts them down.
        run_worker_node(engine_args)
        return 0
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as error:
        raise ValueError(f"--port {args.port}: cannot listen on {args.host}:{args.port} "
                         f"({error.strerror or error}); is another server there?") from None
    try:
        return _serve(args, engine_args, sock, chat_template)
    finally:
        sock.close()


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself where it is a Jinja template (vLLM's rule)."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")


def _serve(args: argparse.Namespace, engine_args: Any, sock: socket.socket, chat_template: str | None) -> int:
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.entrypoints.openai.uvicorn_server import make_server

    engine = AsyncLLMEngine.from_engine_args(engine_args, log_stats=not args.disable_log_stats)
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template  # (the server's tokenizer copies are made from it)
    app = build_app(engine, args)
    server = make_server(app, engine, args.host, args.port, args.uvicorn_log_level,
                         grace_period=args.timeout_graceful_shutdown, read_timeout=args.read_timeout,
                         keep_alive_timeout=args.timeout_keep_alive)
    logging.getLogger(__name__).info(
        "KV cache page: %s%s", page_url(args.host, args.port),
        " (add ?api_key=KEY: the server has an API key)" if args.api_key else "")
    # uvicorn takes over SIGTERM/SIGINT while it runs and, after its graceful shutdown, re-raises
    # the signal against the handlers it found; with the default handlers that would kill the
    # process with the signal instead of exiting 0. Harmless handlers make the re-raise a no-op.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if engine.dead_error is not None:
        logging.getLogger(__name__).error("exiting: the engine core stopped (%s)", engine.dead_error)
        return 1
    return 0 if server.started else 1


def page_url(host: str, port: int) -> str:
    """The live KV-cache page's address as a browser on this machine reaches it."""
    from pagedllm.entrypoints.openai.kv_cache_page import PAGE_PATH

    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"  # listening everywhere includes loopback
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{PAGE_PATH}"


def _exit_now(signum: int, frame: Any) -> None:
    raise SystemExit(0)
