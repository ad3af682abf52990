"""Benchmark request sets: fixed-length random prompts, a ShareGPT-like length mix, or a file.

Prompts are token ids drawn at random from the tokenizer's ordinary (non-special) vocabulary, so a
prompt's length is exact and no two prompts share a prefix by accident (as in vLLM's random dataset).
For HTTP benchmarks the ids are also decoded to text; `prompt_len` is then the text's re-encoded length.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "sharegpt-like")


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    prompt: str  # the ids decoded; empty unless asked for
    prompt_len: int
    output_len: int


def _ordinary_token_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab_size = len(tokenizer)
    ids = [i for i in range(vocab_size) if i not in special]
    if not ids:
        raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
    return ids


def _lognormal_lengths(rng: random.Random, n: int, mean: int, sigma: float, low: int, high: int) -> list[int]:
    """Lengths with the given mean and a long right tail (median = mean * exp(-sigma^2 / 2)), clipped."""
    mu = math.log(mean) - sigma**2 / 2
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def sharegpt_like_lengths(
    num_prompts: int, mean_input_len: int, mean_output_len: int, seed: int, max_model_len: int | None = None
) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs shaped like chat traffic: most prompts short, a few long ones; replies
    similar. ShareGPT's own lengths are roughly log-normal with a spread of about one e-fold (sigma ~ 1 for
    prompts, ~ 0.8 for replies); each is clipped to 4x its mean and the pair to max_model_len."""
    rng = random.Random(seed)
    inputs = _lognormal_lengths(rng, num_prompts, mean_input_len, 1.0, 4, 4 * mean_input_len)
    outputs = _lognormal_lengths(rng, num_prompts, mean_output_len, 0.8, 1, 4 * mean_output_len)
    pairs = []
    for prompt_len, output_len in zip(inputs, outputs):
        if max_model_len is not None and prompt_len + output_len > max_model_len:
            prompt_len = max(1, min(prompt_len, max_model_len // 2))
            output_len = max(1, min(output_len, max_model_len - prompt_len))
        pairs.append((prompt_len, output_len))
    return pairs


def _load_file(path: Path, num_prompts: int) -> list[tuple[str, int | str | None]]:
    """(prompt text, output length, or the reply's text, or None) from a JSON list or JSON lines. A
    record is a string, {"prompt": ..., "output_len"?: ...}, or ShareGPT's {"conversations": [{"value":
    prompt}, {"value": reply}, ...]}, whose reply's token count becomes the output length."""
    text = path.read_text()
    lines = text.splitlines()
    try:
        records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in lines if x.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset {str(path)!r} is neither a JSON list nor JSON lines ({exc}).") from None
    items: list[tuple[str, int | str | None]] = []
    for record in records:
        if isinstance(record, str):
            items.append((record, None))
        elif "conversations" in record:
            turns = record["conversations"]
            if len(turns) >= 2 and turns[0]["value"] and turns[1]["value"]:
                items.append((turns[0]["value"], turns[1]["value"]))
        else:
            items.append((record["prompt"], record.get("output_len")))
        if len(items) >= num_prompts:
            break
    return items


def get_requests(
    dataset: str,
    tokenizer: Any,
    num_prompts: int,
    input_len: int = 128,
    output_len: int = 128,
    seed: int = 0,
    max_model_len: int | None = None,
    with_text: bool = False,
) -> list[SampleRequest]:
    """`dataset` is random (every prompt input_len, every reply output_len), sharegpt-like (those are
    the means) or a path to a JSON/JSONL file."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {input_len} and {output_len}")
    if dataset not in DATASETS:
        return _file_requests(Path(dataset), tokenizer, num_prompts, output_len, max_model_len)
    if dataset == "random":
        lengths = [(input_len, output_len)] * num_prompts
    else:
        lengths = sharegpt_like_lengths(num_prompts, input_len, output_len, seed, max_model_len)
    vocab = _ordinary_token_ids(tokenizer)
    rng = random.Random(seed + 1)
    requests = []
    for prompt_len, out_len in lengths:
        ids = [rng.choice(vocab) for _ in range(prompt_len)]
        text = ""
        if with_text:
            text = tokenizer.decode(ids)
            prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(SampleRequest(ids, text, prompt_len, out_len))
    return requests


def _file_requests(
    path: Path, tokenizer: Any, num_prompts: int, output_len: int, max_model_len: int | None
) -> list[SampleRequest]:
    if not path.is_file():
        raise ValueError(f"--dataset {str(path)!r} is neither {' nor '.join(DATASETS)} nor a file")
    requests = []
    for text, out in _load_file(path, num_prompts):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if isinstance(out, str):
            out_len = len(tokenizer.encode(out, add_special_tokens=False))
        else:
            out_len = output_len if out is None else int(out)
        out_len = max(1, out_len)
        if max_model_len is not None:
            out_len = min(out_len, max_model_len - 1)
            ids = ids[: max(1, max_model_len - out_len)]
        if ids:
            requests.append(SampleRequest(ids, text, len(ids), out_len))
    if not requests:
        raise ValueError(f"--dataset {str(path)!r} holds no usable prompts")
    return requests
