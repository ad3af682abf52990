"""The sampler: logits of one row per request -> next token, with vLLM's sampling parameters.

Order: penalties, min_tokens suppression, then greedy rows take the argmax and random rows divide by
temperature, apply top-k, top-p and min-p, and sample with the exponential-race trick
(argmax(p / q), q ~ Exp(1)), which needs one random draw per vocabulary entry and so lets a seeded row
use its own generator: a seeded request samples the same tokens alone or in any batch.
Logprobs are reported from the raw model distribution, as vLLM does by default.
Structured outputs arrive as a TokenBitmask (a tensor, never a grammar): the rows it names have every
token the grammar forbids set to -inf, in one batched fill, before anything else looks at them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    stop_token_ids: list[int]  # eos (unless ignore_eos) + stop_token_ids, masked before min_tokens


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor               # [N]
    sampled_logprobs: torch.Tensor        # [N] logprob of the chosen token under the raw distribution
    topk_logprobs: torch.Tensor | None    # [N, K]
    topk_token_ids: torch.Tensor | None   # [N, K]
    sampled_ranks: torch.Tensor | None    # [N] 1-based rank of the chosen token


@dataclass
class TokenBitmask:
    """Allowed tokens for some rows of a logits tensor: bit j of word w of bitmask[i] allows token
    32 * w + j in logits row logit_rows[i]."""

    bitmask: torch.Tensor   # [R, ceil(V / 32)] int32
    logit_rows: list[int]   # [R]


_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """In place: forbidden tokens of the masked rows become -inf (the other rows are not touched)."""
    vocab = logits.shape[-1]
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    bits = (bitmask.unsqueeze(-1) >> _BIT_POSITIONS.to(logits.device)) & 1     # [R, W, 32]
    forbidden = (bits == 0).view(bitmask.shape[0], -1)[:, :vocab]
    rows = torch.tensor(mask.logit_rows, dtype=torch.long, device=logits.device)
    logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    penalized = [i for i, r in enumerate(rows) if has_penalties(r.params)]
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
        logits[i] = row
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] already divided by temperature; top_k 0 = off, top_p 1 = off, min_p 0 = off."""
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        remove = ranks >= k
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        remove |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def adjusted_logits(logits: torch.Tensor, rows: list[SamplingRow],
                    token_bitmask: TokenBitmask | None = None) -> torch.Tensor:
    """Logits after the grammar mask, penalties and min_tokens suppression (a new tensor): what both the
    sampler and speculative verification start from."""
    logits = logits.clone()
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask)
    logits = apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        if row.stop_token_ids and len(row.output_token_ids) < row.params.min_tokens:
            allowed_stops = logits[i, row.stop_token_ids].clone()
            logits[i, row.stop_token_ids] = float("-inf")
            if token_bitmask is not None and not bool(torch.isfinite(logits[i]).any()):
                logits[i, row.stop_token_ids] = allowed_stops  # the grammar is complete: it can only end here
    return logits


def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a request samples from (temperature, top-k, top-p, min-p); greedy rows become
    one-hot. Used by the sampler and by speculative verification alike."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device)
    greedy = temperature < 1e-5
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    # clamped to the vocabulary in Python, so a top_k of 2**63 or more never reaches an int64 tensor
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(r.params.top_k, vocab) for r in rows], dtype=torch.long, device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype, device=device)
    probs = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p).softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def exponential_noise(shape: tuple[int, ...], rows: list[SamplingRow], device: torch.device,
                      default_generator: torch.Generator | None) -> torch.Tensor:
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    for i, row in enumerate(rows):
        noise[i].exponential_(generator=row.generator if row.generator is not None else default_generator)
    return noise


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], max_logprobs: int,
                 token_bitmask: TokenBitmask | None = None) -> SamplerOutput:
        raw_logprobs = logits.log_softmax(dim=-1)
        logits = adjusted_logits(logits, rows, token_bitmask)
        greedy = all(r.params.greedy for r in rows)
        if greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            probs = processed_probs(logits, rows)
            noise = exponential_noise(tuple(probs.shape), rows, probs.device, self.generator)
            token_ids = (probs / noise).argmax(dim=-1)
        sampled_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        topk_logprobs = topk_ids = ranks = None
        if max_logprobs >= 0 and any(r.params.logprobs is not None for r in rows):
            if max_logprobs > 0:
                topk_logprobs, topk_ids = raw_logprobs.topk(max_logprobs, dim=-1)
            ranks = (raw_logprobs > sampled_logprobs.unsqueeze(1)).sum(dim=-1) + 1
        return SamplerOutput(token_ids, sampled_logprobs, topk_logprobs, topk_ids, ranks)
