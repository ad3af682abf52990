"""`python -m pagedllm ...` runs the `pagedllm` command (for when its console script is not on PATH)."""

import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
