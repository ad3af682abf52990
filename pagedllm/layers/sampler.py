"""The sampler: logits of one row per request -> next token, with vLLM's sampling parameters.

Order: penalties, min_tokens suppression, then greedy rows take the argmax and random rows divide by
temperature, apply min-p, top-k and top-p (vLLM V1's order; ties rule below) and draw. A seeded row races
its kept tokens: argmax of logit / T + g, g a Gumbel variable computed by hashing (seed, output position,
token id) (seeded_gumbel). Its tokens are a function of those alone: the same alone or in any batch, and
under speculative decoding whatever was proposed; and since a token's noise does not depend on which other
tokens are looked at, the race runs over the best TOP_CANDIDATES tokens (found by torch.topk, not a full
sort) where the kept set lies within them. Unseeded rows share one draw from the engine's generator, over
the same candidates where they suffice. Both are exact in distribution.
Logprobs are reported from the raw model distribution, as vLLM does by default (top-k logprobs and ranks only
when a request asks for them).
Structured outputs arrive as a TokenBitmask (a tensor, never a grammar): the rows it names have every
token the grammar forbids set to -inf, in one batched fill, before anything else looks at them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedllm.layers.custom_op import chosen_on_first_call, uses_cpu_kernels
from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: list[int]  # eos (even with ignore_eos) + stop_token_ids, masked before min_tokens
    # Index of the output token this row draws; None: len(output_token_ids). Set where output_token_ids
    # does not hold the draft tokens before this position (speculative rows that need no history).
    output_index: int | None = None

    @property
    def seeded(self) -> bool:
        return self.params.seed is not None

    @property
    def position(self) -> int:
        return len(self.output_token_ids) if self.output_index is None else self.output_index


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor               # [N]
    sampled_logprobs: torch.Tensor | None  # [N] logprob of the chosen token under the raw distribution;
                                          # None when no row asked for logprobs
    topk_logprobs: torch.Tensor | None    # [N, K]
    topk_token_ids: torch.Tensor | None   # [N, K]
    sampled_ranks: torch.Tensor | None    # [N] 1-based rank of the chosen token


@dataclass
class TokenBitmask:
    """Allowed tokens for some rows of a logits tensor: bit j of word w of bitmask[i] allows token
    32 * w + j in logits row logit_rows[i]."""

    bitmask: torch.Tensor   # [R, ceil(V / 32)] int32
    logit_rows: list[int]   # [R]


def float_rows_on_cpu(x: torch.Tensor) -> bool:
    """Whether x is what the sampler's C++ ops read (layers/csrc/sampler_ops.cpp): a contiguous 2-D float32
    CPU tensor."""
    return x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D tensor (the first of tied maxima). On CPU through a C++ op: torch's row
    argmax compares one element at a time, where the op scans a row at memory speed."""
    if x.is_cpu and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1 and x.stride(0) == x.shape[1]:
        return _cpu_argmax_rows(x)
    return x.argmax(dim=-1)


def _torch_argmax_rows(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


_choose_cpu_argmax_rows = chosen_on_first_call(globals(), "_cpu_argmax_rows",
                                               lambda: torch.ops.pagedllm_cpu_layers.argmax_rows, _torch_argmax_rows)
_cpu_argmax_rows: Callable[[torch.Tensor], torch.Tensor] = _choose_cpu_argmax_rows


_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """In place: forbidden tokens of the masked rows become -inf (the other rows are not touched)."""
    vocab = logits.shape[-1]
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    bits = (bitmask.unsqueeze(-1) >> _BIT_POSITIONS.to(logits.device)) & 1     # [R, W, 32]
    forbidden = (bits == 0).view(bitmask.shape[0], -1)[:, :vocab]
    rows = torch.tensor(mask.logit_rows, dtype=torch.long, device=logits.device)
    logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))


def bad_word_ends(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word after `output_token_ids`: each word's last token where
    the output ends with the tokens before it (a one-token word always)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= len(output_token_ids) and output_token_ids[-prefix:] == word[:-1]):
            banned.append(word[-1])
    return banned


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not penalized:
        return logits
    vocab = logits.shape[-1]
    device = logits.device
    for i in penalized:  # one small vectorized update per penalized request, never per token
        params = rows[i].params
        output_ids = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=device)
        output_ids = output_ids[output_ids < vocab]
        counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
        counts.index_add_(0, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            prompt_ids = torch.tensor(rows[i].prompt_token_ids, dtype=torch.long, device=device)
            seen[prompt_ids[prompt_ids < vocab]] = True
            penalty = params.repetition_penalty
            row = torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(row.dtype)
        if params.logit_bias:
            tokens = [t for t in params.logit_bias if t < vocab]
            row = row.index_add(0, torch.tensor(tokens, dtype=torch.long, device=device),
                                torch.tensor([params.logit_bias[t] for t in tokens], dtype=row.dtype, device=device))
        if params.allowed_token_ids is not None:
            allowed = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=device)
            row = torch.full_like(row, float("-inf")).index_copy(0, allowed, row[allowed])
        banned = bad_word_ends(params.bad_words_token_ids, rows[i].output_token_ids)
        if banned:
            row = row.index_fill(0, torch.tensor(banned, dtype=torch.long, device=device), float("-inf"))
        logits[i] = row
    return logits


# Top-k / top-p look at this many best tokens first (top_candidates, no full-vocabulary sort). A row whose
# kept set may reach past them (top_k above this, top-p mass not reached within them, or a tie at the last
# candidate's logit) tries the next tier of CANDIDATE_TIERS, and past the last one is filtered by the full
# sort, so the result is always exact. 256 holds the top-p 0.9-0.95 nucleus of a trained model at
# temperature 0.7 in nearly every step, not at temperature 1, where 4,096 hold nearly all of the rest for
# far less than a sort of the row (figures in docs/performance/intel-amx.md).
TOP_CANDIDATES = 256
CANDIDATE_TIERS = (TOP_CANDIDATES, 16 * TOP_CANDIDATES)

# The filters, in vLLM V1's order (temperature, min-p, then top-k and top-p), and the tie rule:
#   min-p drops every token with p < min_p * p_max, i.e. with logit < max logit + log(min_p);
#   top-k keeps every token whose logit is at least the k-th largest logit (ties at the k-th value are all
#     kept, as vLLM's `logits < k-th value` mask does), so more than k tokens survive a tie;
#   top-p then keeps the smallest run of best tokens whose mass (renormalized over what min-p and top-k
#     kept) reaches top_p, and every token tied with the last of them: which of several equal logits a sort
#     happens to put first never decides what is kept. top_p = 1 is off.
# Each filter therefore comes down to one logit threshold per row: a token is kept iff its logit >= it.


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] after temperature; rows with min_p 0 are returned as they are."""
    if not bool((min_p > 0).any()):
        return logits
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)  # log 0 = -inf: off
    return logits.masked_fill(logits < threshold, float("-inf"))


def _kept_threshold(values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, log_norm: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, 1] the logit threshold of top-k then top-p over `values`, [N] the top-k set's mass within
    `values`), each row of `values` in descending order with k <= its length. log_norm: the top-p
    normalizer per row, None for the logsumexp of the top-k set."""
    kth = values.gather(1, (k - 1).unsqueeze(1))
    remove = values < kth
    masked = values.masked_fill(remove, float("-inf"))
    if log_norm is None:
        log_norm = masked.logsumexp(dim=-1)
    probs = (masked - log_norm.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    remove |= ((cumulative - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    remove |= ~torch.isfinite(values)
    # The kept tokens are a prefix (the mass before a token only grows); the first one always stays.
    num_kept = (~remove).sum(dim=-1).clamp(min=1)
    return values.gather(1, (num_kept - 1).unsqueeze(1)), cumulative[:, -1]


def _whole_row_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p over whole rows (those no candidate tier holds): rows with top-p alone by a
    threshold found without a sort on CPU (`top_p_threshold`: the mass of a row's values in bins, then a
    sort of one bin), the rest by the full sort."""
    vocab = logits.shape[-1]
    alone = (top_k <= 0) | (top_k >= vocab)
    if not (float_rows_on_cpu(logits) and bool(alone.any()) and uses_cpu_kernels(logits)):
        return _sort_top_k_top_p(logits, top_k, top_p)
    rows = alone.nonzero().flatten()
    sub = _rows_of(logits, rows)
    threshold, special = torch.ops.pagedllm_cpu_sampler.top_p_threshold(sub, top_p[rows])
    if special:
        return _sort_top_k_top_p(logits, top_k, top_p)
    kept = sub.masked_fill(sub < threshold.unsqueeze(1), float("-inf"))
    if len(rows) == logits.shape[0]:
        return kept
    out = logits.clone()
    out[rows] = kept
    rest = (~alone).nonzero().flatten()
    out[rest] = _sort_top_k_top_p(logits[rest], top_k[rest], top_p[rest])
    return out


def _sort_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p by a full sort: the reference, used where the candidate set may not suffice."""
    vocab = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    threshold, _ = _kept_threshold(sorted_logits, k, top_p, None)
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           num_candidates: int = TOP_CANDIDATES
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p over each row's num_candidates best tokens.

    Returns (candidate logits [N, C] in descending order with the removed ones -inf, their token ids [N, C],
    exact [N], the candidates' mass [N] under the distribution top-p normalizes). A row is exact when its
    kept set provably lies within the candidates: top_k <= C (the top-k set is the candidates' prefix and
    top-p renormalizes over it), or no top-k and the candidates' mass under the full softmax already
    reaches top_p (every later token has at least that much mass before it, so top-p removes it); and in
    both cases the threshold lies above the last candidate's logit (else a token tied with it may sit
    outside). Rows that are not exact must be filtered over the whole row.
    Every quantity is per row, so a row's result never depends on the rest of the batch."""
    vocab = logits.shape[-1]
    c = min(num_candidates, vocab)
    values, ids = top_candidates(logits, c)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    within = k <= c
    log_norm = values.new_zeros(values.shape[0])  # overwritten below for every row
    if bool(within.any()):
        kth = values.gather(1, (k.clamp(max=c) - 1).unsqueeze(1))
        log_norm = values.masked_fill(values < kth, float("-inf")).logsumexp(dim=-1)
    if not bool(within.all()):  # without top-k the normalizer is the whole row's
        log_norm = torch.where(within, log_norm, row_logsumexp(logits))
    threshold, mass = _kept_threshold(values, k.clamp(max=c), top_p, log_norm)
    exact = (within | ((k >= vocab) & (mass >= top_p))) & ((threshold.squeeze(1) > values[:, -1]) | (c == vocab))
    return values.masked_fill(values < threshold, float("-inf")), ids, exact, mass


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x.logsumexp(dim=-1) of a 2-D tensor; on CPU in float32 through a C++ op in two passes over each
    row (layers/csrc/sampler_ops.cpp), within a few float32 ulps of torch's."""
    if float_rows_on_cpu(x) and x.shape[1] > 0:
        return _cpu_row_logsumexp(x)
    return x.logsumexp(dim=-1)


def _torch_row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    return x.logsumexp(dim=-1)


_cpu_row_logsumexp: Callable[[torch.Tensor], torch.Tensor] = chosen_on_first_call(
    globals(), "_cpu_row_logsumexp", lambda: torch.ops.pagedllm_cpu_sampler.row_logsumexp, _torch_row_logsumexp)


def kept_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Top-k then top-p over candidate sets of growing size (CANDIDATE_TIERS): ([(rows, candidate logits,
    their token ids)] per tier for the rows whose kept set it provably holds (top_k_top_p_candidates), the
    rows that no tier holds, for the full sort), rows as ascending indices into logits."""
    vocab = logits.shape[-1]
    rows = torch.arange(logits.shape[0], device=logits.device)
    groups, hopeless = [], []
    for tier, num_candidates in enumerate(CANDIDATE_TIERS):
        values, ids, exact, mass = top_k_top_p_candidates(_rows_of(logits, rows), top_k[rows], top_p[rows],
                                                          num_candidates)
        if bool(exact.all()):
            groups.append((rows, values, ids))
            break
        if bool(exact.any()):
            groups.append((rows[exact], values[exact], ids[exact]))
        if num_candidates >= vocab or tier + 1 == len(CANDIDATE_TIERS):
            hopeless.append(rows[~exact])
            break
        # Sorted, no later candidate outweighs an earlier one, so n candidates hold at most n / c times the
        # mass of c: a row without top-k whose next tier cannot reach top_p goes to the whole row now.
        scale = min(CANDIDATE_TIERS[tier + 1], vocab) / num_candidates
        k = top_k[rows]
        out_of_reach = ~exact & ((k <= 0) | (k >= vocab)) & (mass * scale < top_p[rows])
        hopeless.append(rows[out_of_reach])
        rows = rows[~exact & ~out_of_reach]
        if len(rows) == 0:
            break
    rest = torch.cat(hopeless) if hopeless else rows[:0]
    return groups, rest.sort().values


def top_candidates(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(c, dim=-1): each row's c largest values in descending order and their columns. On CPU in
    float32 through a C++ op that keeps the values at or above a threshold (estimated on a sample of a
    long row, from a histogram of a short one) and sorts only those (torch keeps a heap per row): the same
    values; tied values may list their columns in another order, which the filters (they read values) and
    the race (it reads the kept set) never see."""
    if float_rows_on_cpu(x) and x.shape[0] > 0:
        return _cpu_top_candidates(x, c)
    return x.topk(c, dim=-1)


def _torch_top_candidates(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.topk(c, dim=-1)


def _cpp_top_candidates(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids, has_nan = torch.ops.pagedllm_cpu_sampler.top_candidates(x, c)
    return x.topk(c, dim=-1) if has_nan else (values, ids)  # torch orders NaN as the largest


_cpu_top_candidates: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = chosen_on_first_call(
    globals(), "_cpu_top_candidates", lambda: _cpp_top_candidates, _torch_top_candidates)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] already divided by temperature; min-p, then top-k and top-p (see the rule above);
    top_k 0 (or >= V) = off, top_p 1 = off, min_p 0 = off. Rows with neither top-k nor top-p skip those."""
    logits = apply_min_p(logits, min_p)
    vocab = logits.shape[-1]
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    if bool(filtered.any()):
        rows = filtered.nonzero().flatten()
        sub_logits, sub_k, sub_p = logits[rows], top_k[rows], top_p[rows]
        groups, slow = kept_candidates(sub_logits, sub_k, sub_p)
        sub = torch.full_like(sub_logits, float("-inf"))
        for index, values, ids in groups:
            sub[index] = sub[index].scatter_(1, ids, values)
        if len(slow):
            sub[slow] = _whole_row_top_k_top_p(sub_logits[slow], sub_k[slow], sub_p[slow])
        logits = logits.clone()
        logits[rows] = sub
    return logits


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without the copy when rows is every row in order (a [k+1, 49152] float32 copy per step)."""
    return x if rows == list(range(x.shape[0])) else x[rows]


def _rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for an ascending index of x's rows; x itself when that is every row (no copy of the
    whole logits)."""
    return x if len(index) == x.shape[0] else x[index]


def holds_back_stops(row: SamplingRow) -> bool:
    """min_tokens not reached yet: adjusted_logits masks the row's stop tokens."""
    return bool(row.stop_token_ids) and len(row.output_token_ids) < row.params.min_tokens


def adjusted_logits(logits: torch.Tensor, rows: list[SamplingRow],
                    token_bitmask: TokenBitmask | None = None) -> torch.Tensor:
    """Logits after the grammar mask, penalties and min_tokens suppression: what both the sampler and
    speculative verification start from. A new tensor when anything changes, else the input itself (a
    [64, 32000] copy per step is not free), so callers must not modify the result in place."""
    suppress = [i for i, row in enumerate(rows) if holds_back_stops(row)]
    if token_bitmask is None and not suppress and not any(r.params.has_penalties for r in rows):
        return logits
    logits = logits.clone()
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask)
    logits = apply_penalties(logits, rows)
    for i in suppress:
        row = rows[i]
        allowed_stops = logits[i, row.stop_token_ids].clone()
        logits[i, row.stop_token_ids] = float("-inf")
        if token_bitmask is not None and not bool(torch.isfinite(logits[i]).any()):
            logits[i, row.stop_token_ids] = allowed_stops  # the grammar is complete: it can only end here
    return logits


class FilterParams(NamedTuple):
    """Each row's filter parameters as tensors: temperature, top_p and min_p in the logits' dtype, top_k
    (int64) clamped to the vocabulary. The model runner gathers them from its input batch's rows."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    def select(self, index: list[int]) -> FilterParams:
        return FilterParams(*(t[index] for t in self))


def _filter_params(rows: list[SamplingRow], dtype: torch.dtype, device: torch.device, vocab: int) -> FilterParams:
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=dtype, device=device)
    # clamped to the vocabulary in Python, so a top_k of 2**63 or more never reaches an int64 tensor
    top_k = torch.tensor([min(r.params.top_k, vocab) for r in rows], dtype=torch.long, device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=dtype, device=device)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=dtype, device=device)
    return FilterParams(temperature, top_k, top_p, min_p)


def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a request samples from (temperature, top-k, top-p, min-p); greedy rows become
    one-hot. Used by the sampler and by speculative verification alike."""
    temperature, top_k, top_p, min_p = _filter_params(rows, logits.dtype, logits.device, logits.shape[-1])
    greedy = temperature < 1e-5
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    probs = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p).softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, argmax_rows(logits).unsqueeze(1), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


_MASK64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def position_seed(seed: int, position: int) -> int:
    """The 64-bit key of output token `position` of a request seeded with `seed` (splitmix64 of the
    pair, so neighbouring seeds and positions get unrelated streams).

    A seeded request's noise is a function of (seed, position) alone, never of how many draws came
    before it: its tokens are the same alone or in any batch, under any token budget or chunking, and
    with or without speculative decoding, where the number of tokens proposed and verified per step
    depends on all of those."""
    z = (seed + (position + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _int64(x: int) -> int:
    """A 64-bit pattern as the signed value an int64 tensor holds (its arithmetic wraps modulo 2**64)."""
    return x - (1 << 64) if x >= (1 << 63) else x


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> extends the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def position_keys(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """[N] int64: each seeded row's position_seed, as the bit pattern an int64 tensor holds."""
    return torch.tensor([_int64(position_seed(r.params.seed, r.position)) for r in rows], dtype=torch.int64,
                        device=device)


def _seeded_uniform(rows: list[SamplingRow], token_ids: torch.Tensor) -> torch.Tensor:
    """[N, C] float64 uniforms in (0, 1): splitmix64 of (row's position key, token id), vectorized."""
    return _uniform_of_keys(position_keys(rows, token_ids.device), token_ids)


def _uniform_of_keys(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    z = keys.unsqueeze(1) + (token_ids + 1) * _int64(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _int64(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _int64(0x94D049BB133111EB)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11).to(torch.float64) + 0.5) * 2.0 ** -53


def seeded_gumbel(rows: list[SamplingRow], token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [N, C] of each seeded row's tokens `token_ids` [N, C]: -log(E), E ~ Exp(1), a
    function of (seed, position, token id) only, so any subset of a row's tokens gets the noise it would
    get within the whole vocabulary."""
    return -(-_seeded_uniform(rows, token_ids).log()).log()


def _torch_seeded_race(values: torch.Tensor, token_ids: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """The reference race: every token's noise materialised (seeded_gumbel), then one argmax per row."""
    if token_ids is None:
        token_ids = torch.arange(values.shape[1], device=values.device).expand(values.shape[0], -1)
    return (values.to(torch.float64) - (-_uniform_of_keys(keys, token_ids).log()).log()).argmax(dim=-1)


def seeded_race(values: torch.Tensor, token_ids: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """[N] the winning column of each row: argmax over columns j of values[:, j] + the Gumbel noise of token
    token_ids[:, j] (None: token j) at the row's key (position_keys). values: the kept logits, removed
    ones -inf. On CPU in float32 through a C++ op that hashes each token once and takes logarithms only
    for the few tokens that can still win (layers/csrc/sampler_ops.cpp), the same column bit for bit."""
    if float_rows_on_cpu(values):
        return _cpu_seeded_race(values, token_ids, keys)
    return _torch_seeded_race(values, token_ids, keys)


_cpu_seeded_race: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor] = chosen_on_first_call(
    globals(), "_cpu_seeded_race", lambda: torch.ops.pagedllm_cpu_sampler.seeded_race, _torch_seeded_race)


def exponential_noise(shape: tuple[int, ...], rows: list[SamplingRow], device: torch.device,
                      default_generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise over the whole vocabulary, one row per SamplingRow: a seeded row's the exponentials
    behind its seeded_gumbel, the others' from the engine's generator. argmax(p / noise) draws from p."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, row in enumerate(rows) if row.seeded]
    for i, row in enumerate(rows):
        if not row.seeded:
            noise[i].exponential_(generator=default_generator)
    if seeded:
        vocab = torch.arange(shape[1], device=device).expand(len(seeded), shape[1])
        noise[seeded] = (-_seeded_uniform([rows[i] for i in seeded], vocab).log()).to(torch.float32)
    return noise


def sample_kept(logits: torch.Tensor, rows: list[SamplingRow],
                draw: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor],
                params: FilterParams | None = None) -> torch.Tensor:
    """[N] token ids of random rows: temperature and min-p over the whole row, then top-k/top-p over the
    candidates where they provably hold the kept set (else over the whole row); `draw(kept, ids, rows)`
    picks a column of each row of `kept` (logits, the removed ones -inf), `ids` being their token ids
    (None for whole rows: column j is token j) and `rows` their indices in `rows`. Candidate rows are
    drawn first, then whole rows. `params`: the rows' filter parameters where the caller has them as
    tensors (else read from `rows`)."""
    if params is None:
        params = _filter_params(rows, logits.dtype, logits.device, logits.shape[-1])
    temperature, top_k, top_p, min_p = params
    scaled = apply_min_p(logits / temperature.unsqueeze(1), min_p)
    vocab = logits.shape[-1]
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    full = ~filtered
    if bool(filtered.any()):
        rows_f = filtered.nonzero().flatten()
        groups, slow = kept_candidates(_rows_of(scaled, rows_f), top_k[rows_f], top_p[rows_f])
        full[rows_f[slow]] = True
        for index, values, ids in groups:
            rows_c = rows_f[index]
            token_ids[rows_c] = ids.gather(1, draw(values, ids, rows_c).unsqueeze(1)).squeeze(1)
    if bool(full.any()):
        rows_v = full.nonzero().flatten()
        kept = _rows_of(scaled, rows_v)
        whole = filtered[rows_v]  # rows no candidate tier holds: filtered over the whole row (min-p already applied)
        if bool(whole.all()):
            kept = _whole_row_top_k_top_p(kept, top_k[rows_v], top_p[rows_v])
        elif bool(whole.any()):
            kept = kept.clone()
            rows_w = rows_v[whole]
            kept[whole] = _whole_row_top_k_top_p(scaled[rows_w], top_k[rows_w], top_p[rows_w])
        token_ids[rows_v] = draw(kept, None, rows_v)
    return token_ids


def seeded_sample(logits: torch.Tensor, rows: list[SamplingRow], params: FilterParams | None = None) -> torch.Tensor:
    """[N] token ids of seeded random rows from their (adjusted) logits: the Gumbel-max race over the
    tokens that temperature, min-p, top-k and top-p keep. Rows whose kept set lies within the candidates
    race over those only; the race over the whole row picks the same token (the noise is per token)."""

    def race(kept: torch.Tensor, ids: torch.Tensor | None, indices: torch.Tensor) -> torch.Tensor:
        return seeded_race(kept.contiguous(), ids, position_keys([rows[i] for i in indices.tolist()], kept.device))

    return sample_kept(logits, rows, race, params)


def _torch_categorical(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The reference of categorical: the softmax's cumulative sums in float64 (monotone, so a
    zero-probability entry adds no step and is never drawn) and the first index past u times the row's
    total (kept below it, so every draw lands on an entry). The exponential race, argmax(p / q) with
    q ~ Exp(1), draws the same distribution but needs a random number and a log per entry."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def categorical(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N] one draw per row of logits [N, V] from its softmax, by inverting the CDF at u [N] (float64 in
    [0, 1)). On CPU in float32 through a C++ op that needs no probability or cumulative tensor, nor
    torch's float64 cumsum, one scalar add per entry (layers/csrc/sampler_ops.cpp); the same distribution."""
    if float_rows_on_cpu(logits) and logits.shape[1] > 0:
        return _cpu_categorical(logits, u)
    return _torch_categorical(logits, u)


_cpu_categorical: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = chosen_on_first_call(
    globals(), "_cpu_categorical", lambda: torch.ops.pagedllm_cpu_sampler.categorical, _torch_categorical)


def _torch_logprob_stats(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of logprob_stats: one log_softmax, a gather, topk and a count."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    return chosen, top_logprobs, top_ids, ranks


def logprob_stats(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What is reported of each row's distribution log_softmax(logits) [N, V]: the log-probability of
    token_ids [N], its rank (1 + the tokens of higher log-probability), and the k best log-probabilities
    [N, k] with their token ids. On CPU in float32 through a C++ op that makes passes over each row and
    writes no row-sized tensor (layers/csrc/sampler_ops.cpp); where a row holds a NaN or an infinite
    logit, torch's way."""
    if float_rows_on_cpu(logits) and logits.shape[1] > 0:
        return _cpu_logprob_stats(logits, token_ids, k)
    return _torch_logprob_stats(logits, token_ids, k)


def _cpp_logprob_stats(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen, top_logprobs, top_ids, ranks, special = torch.ops.pagedllm_cpu_sampler.logprobs(logits, token_ids, k)
    return _torch_logprob_stats(logits, token_ids, k) if special else (chosen, top_logprobs, top_ids, ranks)


_cpu_logprob_stats: Callable[[torch.Tensor, torch.Tensor, int],
                             tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = chosen_on_first_call(
    globals(), "_cpu_logprob_stats", lambda: _cpp_logprob_stats, _torch_logprob_stats)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], max_logprobs: int,
                 token_bitmask: TokenBitmask | None = None, params: FilterParams | None = None) -> SamplerOutput:
        """`params`: the rows' filter parameters as tensors, where the caller keeps them (else read from
        `rows`)."""
        raw_logits = logits
        logits = adjusted_logits(logits, rows, token_bitmask)
        seeded = [i for i, r in enumerate(rows) if not r.params.greedy and r.seeded]
        unseeded = [i for i, r in enumerate(rows) if not r.params.greedy and not r.seeded]
        # what greedy rows take (a full pass over the logits, skipped when no row is greedy)
        token_ids = argmax_rows(logits) if len(seeded) + len(unseeded) < len(rows) else \
            torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if seeded:
            # Speculative verification of a seeded request draws with the very same function (spec_decoder.py).
            token_ids[seeded] = seeded_sample(select_rows(logits, seeded), [rows[i] for i in seeded],
                                              params.select(seeded) if params is not None else None)
        if unseeded:
            token_ids[unseeded] = self._sample_unseeded(select_rows(logits, unseeded), [rows[i] for i in unseeded],
                                                        params.select(unseeded) if params is not None else None)
        if max_logprobs < 0 or all(r.params.logprobs is None for r in rows):
            # Nobody reads them (a request's cumulative logprob is reported only with its logprobs), and
            # the full-vocabulary pass would cost more than the greedy argmax itself.
            return SamplerOutput(token_ids, None, None, None, None)
        sampled_logprobs, topk_logprobs, topk_ids, ranks = logprob_stats(raw_logits, token_ids, max_logprobs)
        if max_logprobs == 0:
            topk_logprobs = topk_ids = None
        return SamplerOutput(token_ids, sampled_logprobs, topk_logprobs, topk_ids, ranks)

    def _sample_unseeded(self, logits: torch.Tensor, rows: list[SamplingRow],
                         params: FilterParams | None = None) -> torch.Tensor:
        """Rows without a seed share the engine's generator, so their draws come from one call per kind of
        row (sample_kept), each by inverting its distribution's CDF at one uniform per row (categorical)."""

        def draw(kept: torch.Tensor, ids: torch.Tensor | None, indices: torch.Tensor) -> torch.Tensor:
            u = torch.rand(kept.shape[0], dtype=torch.float64, device=kept.device, generator=self.generator)
            return categorical(kept, u)

        return sample_kept(logits, rows, draw, params)
