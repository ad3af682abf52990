"""The sampler's top-k/top-p over a candidate set (issue 14) is exact: the same kept tokens as a full sort,
the full sort wherever the candidates may not hold the kept set, and unseeded rows (which race over the
candidates only, with one shared draw) sample the filtered distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.layers.sampler import (
    TOP_CANDIDATES,
    Sampler,
    SamplingRow,
    _sort_top_k_top_p,
    apply_top_k_top_p_min_p,
)

VOCAB = 4 * TOP_CANDIDATES
P_VALUE_FLOOR = 1e-3  # fixed seeds: deterministic


def reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The full sort. Rows with neither filter stay whole: top_p = 1 must not drop the tail tokens whose
    float32 cumulative mass rounds to 1 before the end (the sort alone would)."""
    off = ((top_k <= 0) | (top_k >= logits.shape[-1])) & (top_p >= 1.0)
    out = torch.where(off.unsqueeze(1), logits, _sort_top_k_top_p(logits, top_k, top_p))
    probs = out.softmax(dim=-1)
    return out.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1), float("-inf"))


def peaked_logits(rows: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g, dtype=torch.float64).float() * scale


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat rows send top-p to the full sort; peaked ones do not
def test_candidates_keep_what_the_full_sort_keeps(scale: float) -> None:
    n = 12
    logits = peaked_logits(n, scale, seed=int(scale * 10))
    top_k = torch.tensor([0, 1, 5, 50, TOP_CANDIDATES, TOP_CANDIDATES + 1, 700, VOCAB, VOCAB + 5, 0, 20, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.99, 0.8, 0.9, 0.7, 1.0, 1.0, 1.0, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0])
    got = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    want = reference(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], logits[kept])
    # a row's result does not depend on its neighbours
    for i in (0, 3, 5):
        alone = apply_top_k_top_p_min_p(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], min_p[i:i + 1])
        assert torch.equal(torch.isfinite(alone[0]), kept[i])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    assert counts[probs <= 0].sum() == 0, "sampled a token of probability 0"
    expected = probs * n
    big = expected >= 5
    obs, exp = counts[big].tolist(), expected[big].tolist()
    small = ~big & (probs > 0)
    if small.any():
        obs.append(counts[small].sum().item())
        exp.append(expected[small].sum().item())
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return 1.0 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(torch.tensor(stat)).item()


@pytest.mark.parametrize(
    "params, scale",
    [
        (dict(temperature=0.8, top_k=20, top_p=0.9), 3.0),   # candidates
        (dict(temperature=1.0, top_p=0.8, min_p=0.02), 4.0),  # candidates, no top-k
        (dict(temperature=1.0, top_p=0.95), 0.7),            # flat: the full sort
        (dict(temperature=1.2), 2.0),                        # no filter: the full vocabulary
    ],
    ids=["top_k_top_p", "top_p_min_p", "top_p_fallback", "plain"],
)
def test_unseeded_rows_sample_the_filtered_distribution(params: dict, scale: float) -> None:
    draws = 3000
    logits = peaked_logits(1, scale, seed=7)
    sp = SamplingParams(max_tokens=1, **params)
    rows = [SamplingRow(sp, [1], [], None, []) for _ in range(draws)]
    tokens = Sampler(torch.Generator().manual_seed(3))(logits.expand(draws, -1).contiguous(), rows, 0).token_ids
    t = torch.tensor([sp.temperature])
    filtered = reference(logits / t, torch.tensor([sp.top_k]), torch.tensor([sp.top_p]), torch.tensor([sp.min_p]))
    probs = filtered.double().softmax(dim=-1)[0]
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert chi_square_p_value(counts, probs) > P_VALUE_FLOOR
