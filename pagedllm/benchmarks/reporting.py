"""What every benchmark command shares at its edge: a one-line error exit and the JSON report file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def fail(message: str) -> int:
    """Print `error: message` to stderr; the exit status of a refused command."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def write_json(path: str | None, report: Any) -> None:
    """Write `report` to `path` (nothing without a path); values JSON cannot hold are written as text."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")


def int_list(text: str) -> list[int]:
    """An argparse type: positive integers separated by commas ("1,16,64")."""
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values
