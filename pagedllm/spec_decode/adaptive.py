"""How many tokens to speculate: per request from its measured acceptance, per step from measured step times.

A model-free proposer (n-gram, suffix) costs next to nothing to ask, but every proposed token is one more
position in the target's pass. Each step, after the proposals are made, `allocate_speculative_tokens`
hands out speculative tokens one at a time to the request whose next token is likeliest to be accepted
(the k-th draft token of a request with per-token acceptance alpha adds alpha^k expected tokens), as long
as the batch's expected tokens per second still rise with the step's cost measured by `StepCostModel`. A
request with poor acceptance gets 0; a batch large enough that a longer pass costs more than its
accepted tokens save gets 0 everywhere. A request at k = 0 still has a proposal made and compared with
what the target then samples (a free, unverified trial), so its acceptance estimate recovers, and k with
it, when its proposals start matching again.

The decisions depend on timing, but outputs never do: greedy verification and a seeded request's
verification both emit the target's own token at each position, whatever was proposed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

# A request's acceptance starts at a prior worth a few trials and then follows its own trials, older ones
# decaying, so that a request that turns from copying its input to free text (or back) is followed within
# a few steps.
ACCEPTANCE_PRIOR = 0.6
ACCEPTANCE_PRIOR_WEIGHT = 4.0
ACCEPTANCE_DECAY = 0.8

# Until step times show otherwise: one more position costs this fraction of a one-token pass (a
# weight-bound pass over a few more rows costs little more than over one).
PRIOR_COST_PER_TOKEN = 0.05
# ...and never less than this (every position costs something: its query, its KV write, its logits row),
# so that timing noise on a small model cannot make a rejected proposal look free.
MIN_COST_PER_TOKEN = 0.01
# Step times are forgotten at this rate per decode step (so the fit follows load and batch changes), and
# the prior slope weighs as much as this many tokens^2 of spread in the measured step sizes.
STEP_COST_DECAY = 0.98
STEP_COST_PRIOR_WEIGHT = 4.0
# A step without speculation is taken to learn the slope (StepCostModel.baseline_due) only after this much
# (decayed) weight of measured steps: a short request keeps its proposals whole.
BASELINE_MIN_WEIGHT = 10.0


class AcceptanceEstimate:
    """alpha = decayed accepted / decayed trials (a trial: a draft token accepted, or the one rejected)."""

    __slots__ = ("accepted", "trials")

    def __init__(self) -> None:
        self.accepted = ACCEPTANCE_PRIOR * ACCEPTANCE_PRIOR_WEIGHT
        self.trials = ACCEPTANCE_PRIOR_WEIGHT

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.accepted = ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.trials = ACCEPTANCE_DECAY * self.trials + num_accepted + (num_accepted < num_draft)

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials


class StepCostModel:
    """T(n) = a + b * n: seconds of a target pass that computes n tokens, fitted by least squares to
    decode steps (weights decaying per step), its slope pulled towards PRIOR_COST_PER_TOKEN * T(1) while
    the measured sizes vary little (at batch 1 with speculation off, all steps compute one token)."""

    def __init__(self) -> None:
        self.weight = self.sum_n = self.sum_t = self.sum_nn = self.sum_nt = 0.0
        self.last_num_tokens = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.last_num_tokens = num_tokens
        d = STEP_COST_DECAY
        self.weight = d * self.weight + 1.0
        self.sum_n = d * self.sum_n + num_tokens
        self.sum_t = d * self.sum_t + seconds
        self.sum_nn = d * self.sum_nn + num_tokens * num_tokens
        self.sum_nt = d * self.sum_nt + num_tokens * seconds

    def spread(self) -> float:
        """The decayed sum of squared deviations of the measured step sizes (tokens^2): what the slope is
        learned from."""
        return self.sum_nn - self.sum_n * self.sum_n / self.weight if self.weight else 0.0

    def baseline_due(self, num_base_tokens: int) -> bool:
        """Whether the next step should not speculate, to measure the step without speculation: the last
        step speculated, and the measured sizes vary too little to tell the slope from the prior. Without
        it a batch whose proposals keep one length computes the same number of tokens every step, the slope
        stays the prior's, and speculation stays on even where each verified position costs more than its
        acceptance brings (at batch 8 with 4-bit weights, say). One such step in about a hundred (the
        spread it adds decays below the prior's weight in that many steps) costs little; where speculation
        pays, the slope learned keeps it on."""
        return (self.weight >= BASELINE_MIN_WEIGHT and self.last_num_tokens > num_base_tokens
                and self.spread() < STEP_COST_PRIOR_WEIGHT)

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before any step was measured."""
        if self.weight == 0:
            return None
        mean_n, mean_t = self.sum_n / self.weight, self.sum_t / self.weight
        spread = self.sum_nn - self.weight * mean_n * mean_n
        co_spread = self.sum_nt - self.weight * mean_n * mean_t
        # the prior slope: T(n) = T(1) * (1 + c * (n - 1)) through the mean point
        prior = PRIOR_COST_PER_TOKEN * mean_t / (1 + PRIOR_COST_PER_TOKEN * (mean_n - 1))
        slope = max(0.0, (co_spread + STEP_COST_PRIOR_WEIGHT * prior) / (max(spread, 0.0) + STEP_COST_PRIOR_WEIGHT))
        return mean_t - slope * mean_n, slope

    def cost_function(self) -> Callable[[int], float]:
        """n -> the predicted seconds of a pass of n tokens (relative units before any measurement)."""
        fit = self.fit()
        if fit is None:
            return lambda n: 1.0 + PRIOR_COST_PER_TOKEN * (n - 1)
        a, b = fit
        one_token = max(a + b, 1e-9)
        if b < MIN_COST_PER_TOKEN * one_token:
            a, b = one_token * (1 - MIN_COST_PER_TOKEN), one_token * MIN_COST_PER_TOKEN
        floor = 1e-3 * one_token  # a noisy fit never predicts a free or negative pass
        return lambda n: max(a + b * n, floor)


def allocate_speculative_tokens(alphas: list[float], max_tokens: list[int], num_base_tokens: int,
                                cost: Callable[[int], float], budget: int) -> list[int]:
    """k per request maximizing expected tokens per second: greedy by marginal gain alpha_i^(k_i + 1).

    max_tokens[i]: the most request i may get (its proposal's length); num_base_tokens: what the next pass
    computes without speculation; budget: the most speculative tokens in all.
    """
    ks = [0] * len(alphas)
    expected = float(len(alphas))  # every request gets one token from a pass, speculating or not
    num_tokens = num_base_tokens
    heap = [(-alpha, i) for i, alpha in enumerate(alphas) if max_tokens[i] > 0 and alpha > 0]
    heapq.heapify(heap)
    while heap and budget > 0:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        # Gains only fall and expected/cost only rises as tokens are added: the first refusal is final.
        if (expected + gain) * cost(num_tokens) <= expected * cost(num_tokens + 1):
            break
        ks[i] += 1
        expected += gain
        num_tokens += 1
        budget -= 1
        if ks[i] < max_tokens[i]:
            heapq.heappush(heap, (-gain * alphas[i], i))
    return ks


def speculative_tokens_per_pass(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """Expected tokens per target forward pass when each of gamma draft tokens is accepted independently
    with probability alpha (Leviathan et al. 2023): (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if acceptance_rate == 1.0:
        return float(num_speculative_tokens + 1)
    return (1 - acceptance_rate ** (num_speculative_tokens + 1)) / (1 - acceptance_rate)
