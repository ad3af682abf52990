"""Speculative verification: the rejection sampler of Leviathan et al. (2023) and Chen et al. (2023).

Given k draft tokens x_1..x_k, proposed one after another from distributions q_1..q_k, and the target's
distributions p_1..p_{k+1} at the same positions (both after the request's temperature, top-k, top-p,
min-p and penalties):

    for i = 1..k:  accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
                   on the first rejection, emit one token from norm(max(0, p_i - q_i)) and stop;
    if all k were accepted, emit a bonus token from p_{k+1}.

Every emitted token is then distributed exactly as if the target had sampled it alone (Leviathan et al.,
Theorem 1; Chen et al., Theorem 1), so speculation changes speed, never the output distribution.

A proposer without probabilities (n-gram lookup) is a point mass, q_i = one_hot(x_i): x_i is accepted
with probability p_i(x_i) and the residual is p_i with x_i removed. Greedy requests (p one-hot at the
argmax) reduce to "accept while x_i equals the target's argmax, then emit the argmax", with no random draw.

Draws use the same exponential race as the sampler: argmax(w / e) with e ~ Exp(1) picks index j with
probability w_j / sum(w), so the residual needs no explicit normalization.

Seeded requests are not verified this way (spec_decoder.py): their emitted token at each position is
the target's own sample there, argmax(p / e) with the noise e of (seed, position) that plain sampling
uses, and a draft token is accepted iff it equals that sample. That is lossless too (every token is a
target sample), and it makes a seeded output independent of the proposals, hence of k, the token budget
and the batch. A draft model samples a seeded request's drafts with the same noise (argmax(q / e)), a
coupling that matches the target's sample with probability at least (1 - d) / (1 + d), d the total
variation distance between p and q (the rejection sampler reaches 1 - d); an n-gram proposal (q a point
mass) is accepted with probability p(x) either way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedllm.layers.sampler import SamplingRow, adjusted_logits, processed_probs
from pagedllm.sampling_params import SamplingParams


@dataclass
class RejectionResult:
    token_ids: list[int]  # the accepted draft tokens, then one correction (or bonus) token
    num_accepted: int     # how many draft tokens were accepted (len(token_ids) - 1)


def sample_from_weights(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to `weights` (1-D, non-negative, not all zero)."""
    noise = torch.empty_like(weights, dtype=torch.float32).exponential_(generator=generator)
    return int((weights / noise).argmax())


def greedy_accept(target_token_ids: list[int], draft_token_ids: list[int]) -> RejectionResult:
    """Greedy verification: `target_token_ids` are the target's argmax at the k+1 positions."""
    k = len(draft_token_ids)
    assert len(target_token_ids) == k + 1
    num_accepted = 0
    while num_accepted < k and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    # The accepted drafts equal the target's argmax there, so the output is the argmax prefix.
    return RejectionResult(list(target_token_ids[:num_accepted + 1]), num_accepted)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> RejectionResult:
    """Verify one request's k draft tokens.

    target_probs: [k+1, V] the target's distributions at the position before each draft token and after
    the last one. draft_probs: [k, V] the distributions the drafts were sampled from, or None for a
    deterministic proposer (q = one-hot at each draft token).
    """
    k = len(draft_token_ids)
    assert target_probs.shape[0] == k + 1, (target_probs.shape, k)
    device = target_probs.device
    if k == 0:
        return RejectionResult([sample_from_weights(target_probs[0], generator)], 0)
    positions = torch.arange(k, device=device)
    draft = torch.tensor(draft_token_ids, dtype=torch.long, device=device)
    p_draft = target_probs[positions, draft]
    q_draft = draft_probs[positions, draft] if draft_probs is not None else torch.ones_like(p_draft)
    # Accept x_i iff u_i < p_i(x_i) / q_i(x_i), written without the division (q may be tiny).
    uniform = torch.rand(k, generator=generator, device=device, dtype=torch.float32)
    accepted = (uniform * q_draft < p_draft).to(torch.int64)
    num_accepted = int(accepted.cumprod(dim=0).sum())  # everything after the first rejection is discarded
    if num_accepted == k:
        bonus = sample_from_weights(target_probs[k], generator)
        return RejectionResult(list(draft_token_ids) + [bonus], k)
    i = num_accepted
    if draft_probs is None:
        residual = target_probs[i].clone()
        residual[draft_token_ids[i]] = 0.0
    else:
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
    if not bool(residual.sum() > 0):
        # Only reachable through rounding when p_i == q_i (a rejection then has probability 0): p_i itself
        # is the right distribution for the emitted token.
        residual = target_probs[i]
    correction = sample_from_weights(residual, generator)
    return RejectionResult(list(draft_token_ids[:i]) + [correction], i)


# ---- p and q: the distributions the request actually samples from -------------------------------------
# Both sides go through the request's penalties, min_tokens suppression, temperature, top-k, top-p and
# min-p. At draft position i the history includes drafts 0..i-1, exactly as if they had been generated.


def needs_history(params: SamplingParams) -> bool:
    return params.has_penalties or params.min_tokens > 0


def row_with_drafts(base: SamplingRow, draft_token_ids: list[int]) -> SamplingRow:
    """The request's row as if `draft_token_ids` had already been generated (the output list is shared
    when nothing reads it; the position always moves on, a seeded row's noise depends on it)."""
    if not draft_token_ids:
        return base
    if not needs_history(base.params):
        return replace(base, output_index=base.position + len(draft_token_ids))
    return replace(base, output_token_ids=base.output_token_ids + draft_token_ids, output_index=None)


def rows_with_drafts(base: SamplingRow, draft_token_ids: list[int], num_rows: int) -> list[SamplingRow]:
    """Row i sees the request's output plus its first i draft tokens."""
    return [row_with_drafts(base, draft_token_ids[:i]) for i in range(num_rows)]


def request_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[N, V] the distribution each row samples from (one-hot at the argmax for greedy rows)."""
    return processed_probs(adjusted_logits(logits, rows), rows)
