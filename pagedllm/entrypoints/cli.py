"""The `pagedllm` command: one sub-command per module, each registering its own flags.

Each sub-command module exposes `add_parser(subparsers)` (which sets `func` on its parser) so this
file stays a table of contents and never grows the sub-commands' logic.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module that implements it
SUBCOMMANDS = {
    "generate": "pagedllm.entrypoints.generate_cmd",
    "serve": "pagedllm.entrypoints.openai.serve_cmd",
    "plan": "pagedllm.planner.cli",
    "bench": "pagedllm.benchmarks.cli",
    "quantize": "pagedllm.entrypoints.quantize_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: paged-attention LLM inference")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # sub-command not built yet
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
