"""The `pagedllm` logger: INFO lines on stderr unless the application configured logging itself.
Set PAGEDLLM_LOGGING_LEVEL (e.g. WARNING) to quieten it."""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                                           datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
