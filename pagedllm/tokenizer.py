"""Loading a model's tokenizer (Hugging Face directory or GGUF file): shared by the in-process engine,
the engine core (grammars compile against the vocabulary) and the server's API process."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The model's tokenizer; as in vLLM, one whose class ships as code in the model directory (auto_map in
    tokenizer_config.json) loads only with trust_remote_code=True."""
    from transformers import AutoTokenizer

    from pagedllm.models.gguf import load_gguf_tokenizer, resolve_gguf_file

    gguf_file = resolve_gguf_file(path)
    if gguf_file is not None:  # built from the file's own metadata, as transformers' gguf_file= does
        return load_gguf_tokenizer(gguf_file)
    if not trust_remote_code and "AutoTokenizer" in _read_auto_map(path):
        # checked here: transformers would otherwise ask on a terminal whether to run the code
        raise ValueError(f"the tokenizer in {path!r} is custom code from the model directory (auto_map in "
                         "tokenizer_config.json); pass trust_remote_code=True (--trust-remote-code) to run it.")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("No tokenizer loaded from %s (%s); only token-id prompts will work.", path, exc)
        return None


def _read_auto_map(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            auto_map = json.load(f).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return {}
    return auto_map if isinstance(auto_map, dict) else {}


def message_text(content: Any) -> str:
    """A chat message's content as a text model's template takes it: a string as is, OpenAI's content parts
    ([{"type": "text", "text": ...}, ...]) joined by newlines, none as "". ValueError for other parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages: content must be a string or a list of content parts, "
                         f"got {type(content).__name__}.")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"messages: unsupported content part of type {kind!r}: this model takes text only.")
        if not isinstance(part.get("text"), str):
            raise ValueError("messages: a text content part's 'text' must be a string.")
        texts.append(part["text"])
    return "\n".join(texts)

