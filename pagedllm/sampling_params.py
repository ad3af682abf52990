"""SamplingParams: how to pick the next tokens of one request (vLLM's fields and defaults)."""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

_SAMPLING_EPS = 1e-5
# Grammar backends GuidedDecodingParams.backend accepts: llguidance is the one bundled (vLLM calls it
# "guidance"); "auto" picks it.
GUIDED_DECODING_BACKENDS = ("auto", "guidance", "llguidance")


@dataclass
class GuidedDecodingParams:
    """Constrain a request's output (vLLM's API): exactly one of a JSON schema, a regex, a list of choices,
    a grammar (Lark, or GBNF/EBNF as llama.cpp writes it) or any JSON object.

    Checked here, so a bad spec is a ValueError naming its field before the request reaches the engine;
    the tokenizer-specific compile happens (once per spec, cached) when the engine admits the request.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    # JSON's whitespace between tokens. By default the compact layout: one space after ":" and ",", no
    # newlines (as OpenAI's structured outputs write JSON), because a sampled model given free whitespace
    # can indent until max_tokens. vLLM's option: none at all.
    disable_any_whitespace: bool = False
    # llguidance's option: any whitespace JSON allows between tokens (spaces, tabs, newlines).
    whitespace_flexible: bool = False
    # vLLM's option: the whitespace allowed between tokens, as a regex (e.g. r"[ ]?").
    whitespace_pattern: str | None = None

    @staticmethod
    def from_optional(json: str | dict[str, Any] | None = None, regex: str | None = None,
                      choice: list[str] | None = None, grammar: str | None = None,
                      json_object: bool | None = None, backend: str | None = None,
                      disable_any_whitespace: bool = False, whitespace_flexible: bool = False,
                      whitespace_pattern: str | None = None) -> GuidedDecodingParams | None:
        if all(arg is None for arg in (json, regex, choice, grammar, json_object)):
            return None
        return GuidedDecodingParams(json=json, regex=regex, choice=choice, grammar=grammar,
                                    json_object=json_object, backend=backend,
                                    disable_any_whitespace=disable_any_whitespace,
                                    whitespace_flexible=whitespace_flexible,
                                    whitespace_pattern=whitespace_pattern)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            # pydantic models: their schema, as vLLM accepts them
            schema = getattr(self.json, "model_json_schema", None)
            if schema is None:
                raise ValueError("json must be a JSON schema (a dict or a JSON string), "
                                 f"got {type(self.json).__name__}.")
            self.json = schema()
        if self.json_object is False:
            self.json_object = None
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError("guided_decoding must have exactly one of json, regex, choice, grammar or json_object; "
                             f"got {kinds or 'none'}.")
        if self.backend is not None and self.backend not in GUIDED_DECODING_BACKENDS:
            raise ValueError(f"backend must be one of {list(GUIDED_DECODING_BACKENDS)}, got {self.backend!r}.")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings.")
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string.")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON: {exc}.") from exc
        if isinstance(self.json, str) or (self.json is not None and not isinstance(self.json, dict)):
            raise ValueError("json must be a JSON schema object.")
        from pagedllm.structured_output.grammar import validate_spec

        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("whitespace_pattern must be a string (a regex).")
        for name in ("disable_any_whitespace", "whitespace_flexible"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if self.disable_any_whitespace and (self.whitespace_flexible or self.whitespace_pattern is not None):
            other = "whitespace_flexible" if self.whitespace_flexible else "whitespace_pattern"
            raise ValueError(f"disable_any_whitespace allows no whitespace, so {other} cannot be given with it.")
        validate_spec(*self.compile_key)

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def compile_key(self) -> tuple[str, str, bool, bool, str | None]:
        """What the compiled grammar depends on: (kind, spec, disable_any_whitespace, whitespace_flexible,
        whitespace_pattern)."""
        return self.kind, self.spec, self.disable_any_whitespace, self.whitespace_flexible, self.whitespace_pattern

    @property
    def spec(self) -> str:
        """The constraint as one string: the cache key of its compiled grammar. Keys keep their order: a
        schema's property order is the order its properties are generated in."""
        value = {"json": self.json, "choice": self.choice, "json_object": True}.get(self.kind)
        if value is None:
            return getattr(self, self.kind)
        return _json.dumps(value, ensure_ascii=False)


# vLLM's newer name (vllm.sampling_params.StructuredOutputsParams)
StructuredOutputsParams = GuidedDecodingParams


class RequestOutputKind(enum.Enum):
    """Which outputs a request yields (vLLM's names and values).

    CUMULATIVE: every output holds everything so far (text, token_ids, logprobs).
    DELTA: every output holds only what is new since the previous one, so a stream's cost per token does
    not grow with the output length (the OpenAI server streams this way).
    FINAL_ONLY: one output, when the request finishes (`LLM.generate` and non-streaming requests).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # vLLM's: only n itself (every sample generated is returned)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's extension point: per-request data for engine components, e.g. {"kv_transfer_params": {...}}
    # for a KV connector (disaggregated prefill), as the OpenAI server's kv_transfer_params field sets it.
    extra_args: dict[str, Any] | None = None
    # Added to the logits before sampling, token id -> bias in [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids)
    allowed_token_ids: list[int] | None = None
    # Keep only the prompt's last k tokens (vLLM's; -1: as many as the context holds, less one)
    truncate_prompt_tokens: int | None = None
    # Words never generated (vLLM's bad_words): a word's last token is masked wherever the output so far
    # ends with the rest of it, the word tokenized as it starts a text and after a space
    bad_words: list[str] | None = None
    # vLLM's newer name for guided_decoding (StructuredOutputsParams): either may be given, not both
    structured_outputs: GuidedDecodingParams | None = None
    # Filled by the engine from bad_words and the tokenizer (vLLM's bad_words_token_ids)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Filled by the engine (vLLM's all_stop_token_ids): stop_token_ids plus the model's EOS ids, whether or
    # not ignore_eos is set. min_tokens masks all of them; EOS ends a request only without ignore_eos.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids) if isinstance(self.stop_token_ids, (list, tuple)) \
            else self.stop_token_ids or []
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}.")
        if self.logit_bias:  # JSON keys are strings: "50256" -> 50256
            try:
                self.logit_bias = {int(token): bias for token, bias in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)[:4]}.") from None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            raise ValueError("bad_words must be a list of strings, got a string.")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.structured_outputs is not None:
            if self.guided_decoding is not None and self.guided_decoding is not self.structured_outputs:
                raise ValueError("structured_outputs and guided_decoding are one setting: give one of them.")
            self.guided_decoding = self.structured_outputs
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check(is_int(self.n) and self.n >= 1, f"n must be at least 1, got {self.n!r}.")
        check(self.best_of is None or self.best_of == self.n,
              f"best_of must be None or n={self.n}: every sample generated is returned (ask for n), got "
              f"{self.best_of!r}.")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
                     "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}.")
        # NaN fails every range check below; infinities pass one-sided ones (temperature >= 0,
        # repetition_penalty > 0) and would turn a row of logits into NaN inside the step.
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                     "top_p", "min_p"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                  f"{name} must be a finite number, got {value!r}.")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        check(self.repetition_penalty > 0.0,
              f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        # any size is fine: the sampler clamps top_k to the vocabulary, as vLLM does
        check(is_int(self.top_k) and self.top_k >= 0,
              f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
              f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        # -1: the whole vocabulary (vLLM's), where max_logprobs allows it
        check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= -1),
              f"logprobs must be a non-negative integer or -1 (the whole vocabulary), got {self.logprobs!r}.")
        check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= -1),
              f"prompt_logprobs must be a non-negative integer or -1 (the whole vocabulary), got "
              f"{self.prompt_logprobs!r}.")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must contain only non-empty strings.")
        check(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must contain only non-negative integers.")
        check(self.logit_bias is None or all(
            token >= 0 and isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100
            for token, bias in self.logit_bias.items()),
            "logit_bias must map non-negative token ids to biases in [-100, 100].")
        check(self.truncate_prompt_tokens is None or (is_int(self.truncate_prompt_tokens) and (
            self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)),
            f"truncate_prompt_tokens must be at least 1 or -1, got {self.truncate_prompt_tokens!r}.")
        check(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            is_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids must be a non-empty list of non-negative token ids.")
        check(self.bad_words is None or all(isinstance(word, str) and word.strip() for word in self.bad_words),
              "bad_words must contain only strings that are not blank.")
        check(self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecodingParams),
              f"guided_decoding must be a GuidedDecodingParams, got {type(self.guided_decoding).__name__}.")
        check(isinstance(self.output_kind, RequestOutputKind),
              f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        check(self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
              f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Anything that changes the request's logits before sampling: penalties, logit_bias,
        allowed_token_ids, bad_words (sampler.apply_penalties)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words))

    @property
    def always_argmax(self) -> bool:
        """Greedy and asking for nothing else (no logprobs of either kind, penalties, min_tokens or
        grammar): every token the sampler gives the request is the argmax of its raw logits."""
        return (self.greedy and self.logprobs is None and self.prompt_logprobs is None and not self.has_penalties
                and not self.min_tokens and self.guided_decoding is None)

    def clone(self) -> SamplingParams:
        copy = SamplingParams.__new__(SamplingParams)
        copy.__dict__.update(self.__dict__)
        copy.stop = list(self.stop)
        copy.stop_token_ids = list(self.stop_token_ids)
        copy.all_stop_token_ids = set(self.all_stop_token_ids)
        copy.extra_args = dict(self.extra_args) if self.extra_args is not None else None
        copy.logit_bias = dict(self.logit_bias) if self.logit_bias is not None else None
        copy.allowed_token_ids = list(self.allowed_token_ids) if self.allowed_token_ids is not None else None
        copy.bad_words = list(self.bad_words) if self.bad_words is not None else None
        copy.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        return copy
