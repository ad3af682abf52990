"""The rejection sampler alone (issue 6): whatever the draft distribution q, every emitted token follows p.

p rows here do not depend on earlier tokens, so the token emitted at position j (when the sampler gets
that far) must be distributed as p_j; a chi-square test over many seeded trials checks it, for a
sampled draft, a deterministic (n-gram) draft, sparse p and q (as after top-k/top-p), and checks the
acceptance rate against the papers' formula sum_x min(p(x), q(x)).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.spec_decode.rejection_sampler import greedy_accept, rejection_sample

VOCAB = 8
K = 3
P_VALUE_FLOOR = 1e-3  # fixed seeds: a correct sampler passes deterministically; a wrong one fails by far


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit; bins with expected count < 5 pooled; tokens of p = 0 must never appear."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum().item()
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, f"emitted tokens of p = 0: {impossible.nonzero().flatten().tolist()}"
    expected = probs * n
    small = (expected < 5) & ~impossible
    big = ~small & ~impossible
    obs, exp = counts[big].tolist(), expected[big].tolist()
    if small.any():
        obs.append(counts[small].sum().item())
        exp.append(expected[small].sum().item())
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    if df == 0:
        return 1.0
    return 1.0 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(torch.tensor(stat)).item()


def random_dist(rows: int, gen: torch.Generator, sparsity: float = 0.0) -> torch.Tensor:
    probs = torch.rand(rows, VOCAB, generator=gen, dtype=torch.float64) ** 2
    if sparsity:
        keep = torch.rand(rows, VOCAB, generator=gen) >= sparsity
        keep[:, 0] = True  # never an empty row
        probs = probs * keep
    return (probs / probs.sum(dim=-1, keepdim=True)).float()


def run_trials(p: torch.Tensor, q: torch.Tensor | None, num_trials: int, seed: int,
               fixed_draft: list[int] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Per position: counts of emitted tokens; and how many trials accepted each number of drafts."""
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    counts = [torch.zeros(VOCAB) for _ in range(K + 1)]
    accepted_hist = [0] * (K + 1)
    if fixed_draft is None:
        assert q is not None
        drafts = torch.multinomial(q, num_trials, replacement=True, generator=draft_gen).T.tolist()
    for trial in range(num_trials):
        draft = fixed_draft if fixed_draft is not None else drafts[trial]
        result = rejection_sample(p, draft, q, verify_gen)
        assert len(result.token_ids) == result.num_accepted + 1
        assert result.token_ids[:result.num_accepted] == draft[:result.num_accepted]
        for pos, token in enumerate(result.token_ids):
            counts[pos][token] += 1
        accepted_hist[result.num_accepted] += 1
    return counts, accepted_hist


def assert_follows_p(counts: list[torch.Tensor], p: torch.Tensor) -> None:
    for pos, c in enumerate(counts):
        if c.sum() >= 50:
            p_value = chi_square_p_value(c, p[pos])
            assert p_value > P_VALUE_FLOOR, f"position {pos}: counts {c.tolist()} vs p {p[pos].tolist()}"


@pytest.mark.parametrize("sparsity", [0.0, 0.4], ids=["dense", "sparse"])
def test_emitted_tokens_follow_target_with_sampled_draft(sparsity: float) -> None:
    gen = torch.Generator().manual_seed(11 + int(sparsity * 10))
    p = random_dist(K + 1, gen, sparsity)
    q = random_dist(K, gen, sparsity)
    num_trials = 8000
    counts, accepted_hist = run_trials(p, q, num_trials, seed=5)
    assert_follows_p(counts, p)
    # Position 0 is accepted with probability sum_x min(p(x), q(x)) (Leviathan et al., definition of beta).
    beta = torch.minimum(p[0], q[0]).sum().item()
    accepted_first = 1 - accepted_hist[0] / num_trials
    sd = (beta * (1 - beta) / num_trials) ** 0.5
    assert abs(accepted_first - beta) < 5 * sd, (accepted_first, beta)
    assert 0 < accepted_hist[0] < num_trials, "both acceptance and rejection must be exercised"


def test_emitted_tokens_follow_target_with_point_mass_draft() -> None:
    """The n-gram case: the same fixed proposal every time, q = one-hot; still exactly p."""
    gen = torch.Generator().manual_seed(3)
    p = random_dist(K + 1, gen)
    draft = [int(p[i].argmax()) for i in range(K)]  # a likely proposal, so later positions get samples
    num_trials = 8000
    counts, accepted_hist = run_trials(p, None, num_trials, seed=9, fixed_draft=draft)
    assert_follows_p(counts, p)
    expected = p[0, draft[0]].item()
    sd = (expected * (1 - expected) / num_trials) ** 0.5
    assert abs((1 - accepted_hist[0] / num_trials) - expected) < 5 * sd


def test_draft_equal_to_target_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(4)
    p = random_dist(K + 1, gen)
    _, accepted_hist = run_trials(p, p[:K].clone(), 500, seed=2)
    assert accepted_hist[K] == 500


def test_token_of_zero_target_probability_is_always_rejected() -> None:
    p = torch.zeros(K + 1, VOCAB)
    p[:, 1] = 1.0
    q = torch.full((K, VOCAB), 1.0 / VOCAB)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        result = rejection_sample(p, [2, 1, 1], q, gen)
        assert result.token_ids == [1] and result.num_accepted == 0


def test_seeded_generator_reproduces() -> None:
    gen = torch.Generator().manual_seed(1)
    p, q = random_dist(K + 1, gen), random_dist(K, gen)
    draft = [0, 1, 2]
    first = [rejection_sample(p, draft, q, torch.Generator().manual_seed(s)).token_ids for s in range(20)]
    again = [rejection_sample(p, draft, q, torch.Generator().manual_seed(s)).token_ids for s in range(20)]
    assert first == again


def test_greedy_accepts_while_draft_matches_argmax() -> None:
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]).token_ids == [5, 6, 7, 8]
    result = greedy_accept([5, 6, 7, 8], [5, 9, 7])
    assert result.token_ids == [5, 6] and result.num_accepted == 1
    assert greedy_accept([4, 6], [5]).token_ids == [4]
