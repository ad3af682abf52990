"""The `pagedllm` command: one sub-command per module, each registering its own flags.

Each sub-command module exposes `add_parser(subparsers)` (which sets `func` on its parser) so this
file stays a table of contents and never grows the sub-commands' logic. What every command shares
lives here: errors as one line (the traceback behind `--debug` or PAGEDLLM_LOGGING_LEVEL=DEBUG),
quiet exits on Ctrl-C (130) and on a closed pipe (`pagedllm plan | head`), and help that shows each
default once.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pagedllm import envs

# sub-command name -> module that implements it
SUBCOMMANDS = {
    "generate": "pagedllm.entrypoints.generate_cmd",
    "chat": "pagedllm.entrypoints.chat_cmd",
    "serve": "pagedllm.entrypoints.openai.serve_cmd",
    "plan": "pagedllm.planner.cli",
    "bench": "pagedllm.benchmarks.cli",
    "quantize": "pagedllm.entrypoints.quantize_cmd",
    "tune": "pagedllm.entrypoints.tune_cmd",
    "router": "pagedllm.entrypoints.router",
}

# Errors a user can cause (a bad flag value, a missing file, an unsupported feature): one line, exit 2.
USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError, NotADirectoryError, PermissionError)


def _connection_errors() -> tuple[type[BaseException], ...]:
    """A server that is not there (`chat --url`, `bench serve`): a one-line error, not a traceback."""
    import httpx
    import openai

    return ConnectionError, httpx.TransportError, openai.APIConnectionError


def _has_default(action: argparse.Action) -> bool:
    # identity, not equality: a default of 0 or 0.0 is worth showing, though 0 == False
    return not (action.default is None or action.default is False or action.default is argparse.SUPPRESS)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends '(default: X)' only where the help text does not already state its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "default" in help_text.lower() or not _has_default(action):
            return help_text
        return super()._get_help_string(action)


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if action.help is None and _has_default(action):
            action.help = "(default: %(default)s)"  # argparse prints nothing for a flag without help
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


def _add_unavailable(subparsers: argparse._SubParsersAction, name: str, package: str) -> None:
    def refuse(args: argparse.Namespace) -> int:
        print(f"error: pagedllm {name} needs the package {package!r}, which is not installed (pip install "
              f"{package})", file=sys.stderr)
        return 2

    # Takes whatever follows (no prefix character: flags are plain words here) and refuses it.
    sub = subparsers.add_parser(name, help=f"(unavailable: needs {package})", add_help=False, prefix_chars="\0")
    sub.add_argument("rest", nargs="*")
    sub.set_defaults(func=refuse)


class _HelpEnvAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(envs.help_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: paged-attention LLM inference")
    parser.add_argument("--debug", action="store_true",
                        help="print tracebacks and DEBUG logs (also accepted after the sub-command)")
    parser.add_argument("--help-env", action=_HelpEnvAction, help="list the environment variables pagedllm reads")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # sub-command not built yet
            # A package this sub-command needs is missing (a partial install): the others still work.
            _add_unavailable(subparsers, name, exc.name or str(exc))
            continue
        module.add_parser(subparsers)
    _use_formatter(parser)
    return parser


def _debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """`--debug` anywhere on the line (before `--`), so `pagedllm serve --debug` works too."""
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    rest = [arg for i, arg in enumerate(argv) if not (i < end and arg == "--debug")]
    env_debug = envs.value("PAGEDLLM_LOGGING_LEVEL").upper() == "DEBUG"
    return debug or env_debug, rest


def main(argv: list[str] | None = None) -> int:
    debug, argv = _debug_requested(list(sys.argv[1:] if argv is None else argv))
    if debug:
        logging.getLogger("pagedllm").setLevel(logging.DEBUG)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("\naborted (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`pagedllm plan | head`): stop quietly, and keep Python's exit-time flush
        # of stdout from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if debug or not isinstance(exc, USER_ERRORS + _connection_errors()):
            raise
        message = str(exc) or type(exc).__name__
        request = getattr(exc, "request", None)  # httpx's and openai's: the URL no server answered
        if not isinstance(exc, USER_ERRORS) and request is not None:
            message = f"cannot reach {request.url}: {message}"
        print(f"error: {message.splitlines()[0] if message else message}"
              + (" (more lines: rerun with --debug)" if len(message.splitlines()) > 1 else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
