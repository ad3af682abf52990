"""Models that ship with pagedllm, so its commands work on a machine with no network.

Both are tiny Llama models of Python code trained by `tools/train_demo_models.py` (see each
directory's README.md): a target and a draft distilled from it for speculative decoding.
"""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
TARGET_MODEL_NAME = "pycode-target"
DRAFT_MODEL_NAME = "pycode-draft"


def default_model_path() -> str:
    """Directory of the bundled target model (Hugging Face format), as a str for from_pretrained."""
    return str(MODELS_DIR / TARGET_MODEL_NAME)


def default_draft_path() -> str:
    """Directory of the bundled draft model, distilled from the target and sharing its tokenizer."""
    return str(MODELS_DIR / DRAFT_MODEL_NAME)


def installed_model_path() -> str | None:
    """The bundled target's directory if it is installed (commands fall back to it when no model is
    given), else None."""
    path = default_model_path()
    return path if os.path.isfile(os.path.join(path, "config.json")) else None
