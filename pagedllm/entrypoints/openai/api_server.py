"""vLLM's `python -m vllm.entrypoints.openai.api_server --model MODEL ...`: `pagedllm serve`, the same
flags, for scripts that start the server that way."""

from __future__ import annotations

import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
