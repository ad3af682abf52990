"""The command line and the servers."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """argparse type of a TCP port: checked as the flags are read, not after the model has loaded."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {port}")
    return port
