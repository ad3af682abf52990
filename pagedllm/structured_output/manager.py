"""The StructuredOutputManager: compiled grammars (cached), one matcher per request, the step's bitmask."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.sampling_params import GuidedDecodingParams

if TYPE_CHECKING:
    from pagedllm.core_types.scheduler_output import ScheduledRequest
    from pagedllm.engine.request import Request
    from pagedllm.layers.sampler import TokenBitmask

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse: a server sees the same few schemas again and again.
COMPILED_GRAMMAR_CACHE_SIZE = 128


@dataclass
class GrammarBitmask:
    """The allowed tokens of one step's constrained rows. Bit j of word w of a row allows token 32 * w + j.

    A request that samples gets 1 + len(spec_token_ids) consecutive rows, starting at first_row[id]:
    the position after its last known token, then the position after each draft token.
    """

    bitmask: torch.Tensor        # [rows, ceil(vocab / 32)] int32, on the CPU
    first_row: dict[str, int]

    def select(self, placements: Iterable[tuple[str, int, int]]) -> TokenBitmask | None:
        """The sampler's view for one logits tensor: placements are (request id, its first logits row,
        number of positions). None when no placed request is constrained."""
        from pagedllm.layers.sampler import TokenBitmask

        mask_rows: list[int] = []
        logit_rows: list[int] = []
        for request_id, logit_row, num_positions in placements:
            first = self.first_row.get(request_id)
            if first is None:
                continue
            mask_rows.extend(range(first, first + num_positions))
            logit_rows.extend(range(logit_row, logit_row + num_positions))
        if not mask_rows:
            return None
        return TokenBitmask(self.bitmask[mask_rows], logit_rows)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._compiled: OrderedDict[tuple[str, str, bool, bool, str | None], Any] = OrderedDict()
        self.grammars: dict[str, Any] = {}   # request id -> RequestGrammar
        self.num_compiles = 0

    # ---- compile (at admission) ----
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf
            from transformers import PreTrainedTokenizerFast

            if not isinstance(self.tokenizer, PreTrainedTokenizerFast):
                raise ValueError("guided_decoding needs the model's fast (Rust) tokenizer, which this model "
                                 "does not have.")
            # Building the token trie costs tens of ms (about 1 s for 150k-token vocabularies): once per engine.
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer

    def compile(self, params: GuidedDecodingParams):
        """A matcher in its start state for these params: compiled once per (kind, spec), then copied."""
        import llguidance

        from pagedllm.structured_output.grammar import grammar_definition, parser_limits

        key = params.compile_key
        template = self._compiled.get(key)
        if template is not None:
            self._compiled.move_to_end(key)
            return template
        grammar = grammar_definition(*key)
        template = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            raise ValueError(f"{params.kind} cannot be compiled by the grammar library (llguidance) for this "
                             f"tokenizer: {template.get_error().strip()}")
        # The lexer is built lazily: a pattern past the library's limits ("(b{1000}){1000}") compiles, and
        # its first token overflows the lexer, which every copy shares: its requests would run unconstrained
        # or end at once. Try the first two steps on a copy (this template is then never cached).
        probe = template.deep_copy()
        words = np.frombuffer(probe.compute_bitmask(), dtype=np.uint32)
        allowed = np.flatnonzero(words)
        if len(allowed) and not probe.is_error():
            word = int(allowed[0])
            lowest = int(words[word]) & -int(words[word])
            probe.consume_token(word * 32 + lowest.bit_length() - 1)
            probe.compute_bitmask()
        if probe.is_error():
            raise ValueError(f"{params.kind} exceeds the grammar library's (llguidance) limits for this "
                             f"tokenizer: {probe.get_error().strip().splitlines()[0]}")
        self.num_compiles += 1
        self._compiled[key] = template
        if len(self._compiled) > COMPILED_GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return template

    # ---- per request ----
    def _grammar(self, request: Request):
        grammar = self.grammars.get(request.request_id)
        if grammar is None:
            from pagedllm.structured_output.grammar import RequestGrammar

            params = request.sampling_params.guided_decoding
            assert params is not None
            # deep_copy of the compiled start state costs tens of us; a fresh compile costs ms.
            grammar = self.grammars[request.request_id] = RequestGrammar(self.compile(params).deep_copy())
        return grammar

    def free(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)

    # ---- per step (called by the scheduler once the step's plan is final) ----
    def grammar_bitmask(self, scheduled: list[ScheduledRequest]) -> GrammarBitmask | None:
        constrained = [s for s in scheduled if s.sample and s.request.sampling_params.guided_decoding is not None]
        if not constrained:
            return None  # unconstrained steps allocate nothing
        num_rows = sum(1 + len(s.spec_token_ids) for s in constrained)
        bitmask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        first_row: dict[str, int] = {}
        row = 0
        for s in constrained:
            grammar = self._grammar(s.request)
            grammar.sync(s.request.output_token_ids)
            if grammar.failed:
                logger.warning("Request %s accepted a token its grammar refuses; its output is no longer "
                               "constrained.", s.request.request_id)
                self.free(s.request.request_id)
                s.request.sampling_params.guided_decoding = None
                continue
            grammar.fill(bitmask, row, s.spec_token_ids)
            first_row[s.request.request_id] = row
            row += 1 + len(s.spec_token_ids)
        return GrammarBitmask(bitmask, first_row)
