"""`pagedllm serve [MODEL]`: the OpenAI-compatible server on uvicorn.

Every engine argument of `LLM` is a flag spelled as in vLLM (EngineArgs.add_cli_args). With no model
it serves the bundled demo model. It listens on loopback unless told otherwise.

Shutdown on SIGTERM or Ctrl-C: uvicorn stops accepting connections and lets in-flight requests run
for --timeout-graceful-shutdown seconds, then cancels them; the app's lifespan then aborts whatever
is left in the engine and stops its thread, and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from pagedllm.assets import installed_model_path

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing the server is an explicit choice (--host 0.0.0.0)
DEFAULT_PORT = 8000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import EngineArgs

    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, ...).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory or Hugging Face id (default: the bundled demo model)")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the API (default: "
                             "$PAGEDLLM_API_KEY, else open)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model path)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 while this many requests wait for their first token "
                             "(default: unbounded)")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024,
                        help="answer 413 to bodies larger than this")
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGTERM before being aborted")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run_server)
    return parser


def resolve_model(args: argparse.Namespace) -> str | None:
    model = args.model_tag or getattr(args, "model", None)
    if model:
        return str(model)
    return installed_model_path()


def run_server(args: argparse.Namespace) -> int:
    # a SIGTERM while the model loads has nothing in flight to wait for: just exit 0
    signal.signal(signal.SIGTERM, _exit_now)
    import uvicorn

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.server import build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = resolve_model(args)
    if model is None:
        print("pagedllm serve: no model given and the bundled demo model is not installed; "
              "pass a model directory: pagedllm serve PATH", file=sys.stderr)
        return 2
    if args.model_tag is None and getattr(args, "model", None) is None and not args.served_model_name:
        args.served_model_name = [os.path.basename(model.rstrip("/"))]  # "pycode-target", not a path
    args.model = model
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        print("pagedllm serve: --max-waiting-requests must be >= 0", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = model
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    app = build_app(engine, args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown, access_log=False)
    server = uvicorn.Server(config)
    logging.getLogger(__name__).info(
        "KV cache page: %s%s", page_url(args.host, args.port),
        " (add ?api_key=KEY: the server has an API key)" if args.api_key else "")
    # uvicorn takes over SIGTERM/SIGINT while it runs and, after its graceful shutdown, re-raises
    # the signal against the handlers it found; with the default handlers that would kill the
    # process with the signal instead of exiting 0. Harmless handlers make the re-raise a no-op.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.shutdown()
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
