"""Speculative decoding: proposers (draft model, n-gram, suffix tree) and lossless verification.

Configured with vLLM's two spellings: `LLM(model=..., speculative_model=draft, num_speculative_tokens=k)`
or `speculative_config={"method": "draft_model" | "ngram" | "suffix", "model": ..., "num_speculative_tokens": k,
"prompt_lookup_min": ..., "prompt_lookup_max": ..., "suffix_decoding_max_tree_depth": ...,
"suffix_decoding_max_cached_requests": ..., "suffix_decoding_max_spec_factor": ...,
"suffix_decoding_min_token_prob": ..., "quantization": "int8" | "fp8"}` (also `--speculative-model`,
`--num-speculative-tokens`, `--speculative-config` on the command line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.config import ModelConfig

METHODS = ("draft_model", "ngram", "suffix")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
               "adaptive_num_speculative_tokens", "quantization") + SUFFIX_KEYS
# Proposers that need no model: a proposal costs next to nothing, so k may adapt down to 0 (and back).
MODEL_FREE_METHODS = ("ngram", "suffix")
# vLLM's default when neither bound is given: look up 5-grams only.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeArgs(Protocol):
    """The engine arguments speculative decoding reads (EngineArgs has them)."""

    speculative_config: dict[str, Any] | None
    speculative_model: str | None
    num_speculative_tokens: int | None


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    draft_model_config: ModelConfig | None = None
    # Beyond vLLM: pick each request's k from its running acceptance and the measured cost of a longer
    # target pass (1..num_speculative_tokens for a draft model; 0..num_speculative_tokens for the
    # model-free proposers, whose k comes back from 0 when their unverified proposals start matching).
    # On by default for the model-free proposers, so that speculation never makes decoding slower.
    adaptive_num_speculative_tokens: bool = False
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_engine_args(cls, args: SpeculativeArgs, target: ModelConfig) -> SpeculativeConfig | None:
        raw: dict[str, Any]
        if args.speculative_config:
            if not isinstance(args.speculative_config, dict):
                raise ValueError("speculative_config must be a dict or a JSON object string.")
            if args.speculative_model is not None:
                raise ValueError("give either speculative_model or speculative_config, not both.")
            raw = dict(args.speculative_config)
            unknown = sorted(set(raw) - set(CONFIG_KEYS))
            if unknown:
                raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {list(CONFIG_KEYS)}.")
            if raw.get("num_speculative_tokens") is None and args.num_speculative_tokens is not None:
                raw["num_speculative_tokens"] = args.num_speculative_tokens
        elif args.speculative_model is not None:
            raw = {"model": args.speculative_model, "num_speculative_tokens": args.num_speculative_tokens}
        elif args.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens needs speculative_model or speculative_config.")
        else:
            return None

        if raw.get("model") == "[ngram]" and raw.get("method") in (None, "ngram"):  # (vLLM's older spelling)
            raw = {**raw, "method": "ngram", "model": None}
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {list(METHODS)} (or give a draft model), "
                             f"got {method!r}.")
        suffix = {key: raw.pop(key) for key in SUFFIX_KEYS if raw.get(key) is not None}
        if suffix and method != "suffix":
            raise ValueError(f"speculative_config {sorted(suffix)} apply to method 'suffix', not {method!r}.")
        k = raw.get("num_speculative_tokens")
        if k is None and method == "suffix":  # vLLM: as many as the tree is deep
            k = suffix.get("suffix_decoding_max_tree_depth", cls.suffix_decoding_max_tree_depth)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer of at least 1, got {k!r}.")
        adaptive = raw.get("adaptive_num_speculative_tokens")
        if adaptive is None:
            adaptive = method in MODEL_FREE_METHODS
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive_num_speculative_tokens must be true or false, got {adaptive!r}.")
        config = cls(method=method, num_speculative_tokens=k, adaptive_num_speculative_tokens=adaptive)
        if method in MODEL_FREE_METHODS and raw.get("quantization") is not None:
            raise ValueError(f"speculative_config quantization applies to a draft model, not to method {method!r}.")
        if method == "suffix":
            for key, value in suffix.items():
                setattr(config, key, value)
            config.validate_suffix()
            return config
        if method == "ngram":
            low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
            # vLLM: one bound given means both; none means 5.
            low = low if low is not None else (high if high is not None else DEFAULT_PROMPT_LOOKUP)
            high = high if high is not None else low
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{name} must be an integer of at least 1, got {value!r}.")
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high}).")
            config.prompt_lookup_min, config.prompt_lookup_max = low, high
            return config

        model = raw.get("model")
        name = "speculative_config model" if args.speculative_config else "speculative_model"
        if not isinstance(model, str) or not os.path.isdir(model):
            raise ValueError(f"{name} must be a local model directory; {model!r} does not exist.")
        # As in vLLM, the draft runs in the target's dtype (so dtype="auto" resolves once, against the
        # CPU's flags: a bf16 draft checkpoint beside a target run in fp32 would otherwise decode in
        # bf16 on a CPU without bf16 matmul units, several times slower), and is quantized only when
        # speculative_config says so (or its checkpoint is).
        draft = ModelConfig.from_pretrained(model, target.dtype, target.max_model_len,
                                            quantization=raw.get("quantization"))
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"{name} has vocab_size {draft.vocab_size} but the target has {target.vocab_size}: "
                             "the draft must share the target's tokenizer and vocabulary.")
        config.model = model
        config.draft_model_config = draft
        return config

    def validate_suffix(self) -> None:
        for key, low in (("suffix_decoding_max_tree_depth", 2), ("suffix_decoding_max_cached_requests", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key} must be an integer of at least {low}, got {value!r}.")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be a positive number, got {factor!r}.")
        if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}.")
        self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob = float(factor), float(prob)
