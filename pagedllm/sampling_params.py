"""SamplingParams: how to pick the next tokens of one request (vLLM's fields and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
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
    # Filled by the engine: every token id that ends generation (eos plus stop_token_ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
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
        check(isinstance(self.top_k, int) and self.top_k >= 0,
              f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
              f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}.")
        check(self.prompt_logprobs is None or self.prompt_logprobs >= 0,
              f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must contain only non-empty strings.")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must contain only non-negative integers.")
        check(self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
              f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> SamplingParams:
        copy = SamplingParams.__new__(SamplingParams)
        copy.__dict__.update(self.__dict__)
        copy.stop = list(self.stop)
        copy.stop_token_ids = list(self.stop_token_ids)
        copy.all_stop_token_ids = set(self.all_stop_token_ids)
        return copy
