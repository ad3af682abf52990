"""The n-gram (prompt-lookup) proposer: no model, just the request's own tokens.

If the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred earlier in the prompt
or output, propose the tokens that followed that earlier occurrence. Code editing, summarizing and
retrieval answers repeat long stretches of their input, which this catches for free. The proposal is
deterministic, so the rejection sampler treats it as a point mass (draft_probs None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.spec_decode.proposer import ModelFreeProposer

if TYPE_CHECKING:
    from pagedllm.spec_decode.proposer import ProposeInput

# Look back at most this many tokens: a bounded cost per step even for very long contexts.
MAX_LOOKUP_TOKENS = 8192


@dataclass
class NgramProposer(ModelFreeProposer):
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose_tokens(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed an earlier occurrence of the longest matching suffix (the
        latest one followed by `num_tokens` tokens, else the earliest); [] if no suffix of length >=
        prompt_lookup_min occurred before."""
        if num_tokens <= 0:
            return []
        tokens = np.asarray(token_ids[-MAX_LOOKUP_TOKENS:], dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            # Windows start at i = 0 .. length-n-1: each has at least one token after it, and the
            # suffix itself (i = length-n) is excluded.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(matches):
                # The most recent occurrence with a full continuation: in loops and edits the latest context
                # is the best guide, but in a short loop the very latest one is followed by too few tokens.
                full = matches[matches + n + num_tokens <= length]
                start = int(full[-1] if len(full) else matches[0]) + n
                return tokens[start:start + num_tokens].tolist()
        return []

    def propose(self, inputs: ProposeInput) -> dict[str, tuple[list[int], None]]:
        proposals: dict[str, tuple[list[int], None]] = {}
        for request, k in zip(inputs.requests, inputs.num_spec_tokens):
            tokens = self.propose_tokens(request.all_token_ids, k)
            if tokens:
                proposals[request.request_id] = (tokens, None)
        return proposals
