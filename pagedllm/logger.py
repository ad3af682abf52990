"""The `pagedllm` logger: INFO lines on stderr unless the application configured logging itself.
Set PAGEDLLM_LOGGING_LEVEL (e.g. WARNING) to quieten it."""

from __future__ import annotations

import logging

from pagedllm import envs


def configure_logging() -> None:
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                                           datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(envs.value("PAGEDLLM_LOGGING_LEVEL").upper())
    logger.propagate = False
