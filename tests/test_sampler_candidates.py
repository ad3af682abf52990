"""The sampler's filters: min-p before top-k/top-p (vLLM V1's order) and one tie rule (a filter never
separates tokens of equal logit). The top-k/top-p over a candidate set (issue 14) is exact: the same kept
tokens as the rule written out, a larger candidate set and then the full sort wherever the candidates may
not hold the kept set, and unseeded rows (which race over the candidates only, with one shared draw) and
seeded rows (a Gumbel race whose noise is a hash of seed, position and token id) sample the filtered
distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

import pagedllm.layers.sampler as sampler
from pagedllm import SamplingParams
from pagedllm.cpu_kernels import load_cpu_kernels
from pagedllm.layers.sampler import (
    CANDIDATE_TIERS,
    TOP_CANDIDATES,
    Sampler,
    SamplingRow,
    _torch_categorical,
    apply_top_k_top_p_min_p,
    categorical,
    exponential_noise,
    kept_candidates,
    processed_probs,
    seeded_gumbel,
    seeded_sample,
)

VOCAB = 4 * TOP_CANDIDATES
P_VALUE_FLOOR = 1e-3  # fixed seeds: deterministic


def reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The rule written out row by row, in float64: min-p first (vLLM V1's order), then top-k keeping every
    token tied with the k-th logit, then the smallest run of best tokens whose renormalized mass reaches
    top_p plus every token tied with its last one. top_p = 1 is off: it must not drop the tail tokens whose
    float32 cumulative mass rounds to 1 before the end."""
    out = logits.clone()
    vocab = logits.shape[-1]
    for i, row in enumerate(logits.double()):
        keep = torch.ones(vocab, dtype=torch.bool)
        if min_p[i] > 0:
            probs = row.softmax(dim=-1)
            keep &= probs >= probs.max() * float(min_p[i])
        k = int(top_k[i])
        if 0 < k < vocab:
            survivors = row[keep].sort(descending=True).values
            keep &= row >= survivors[min(k, len(survivors)) - 1]
        if top_p[i] < 1.0:
            values = row.masked_fill(~keep, float("-inf"))
            order = values.argsort(descending=True)
            probs = values.softmax(dim=-1)[order]
            before = probs.cumsum(dim=-1) - probs
            last = max(int((before < float(top_p[i])).sum()) - 1, 0)
            keep &= row >= values[order[last]]
        out[i] = logits[i].masked_fill(~keep, float("-inf"))
    return out


def peaked_logits(rows: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g, dtype=torch.float64).float() * scale


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat rows send top-p past the first candidates
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


def test_each_candidate_tier_and_the_full_sort_keep_what_the_rule_keeps(monkeypatch) -> None:
    """Rows of 8,192 logits: peaked ones kept within the first 256 candidates, flatter ones within the
    next tier's 4,096, the flattest over the whole row only; each row the rule's kept set, whichever path."""
    gen = torch.Generator().manual_seed(11)
    scales = torch.tensor([5.0, 2.5, 0.3, 5.0, 2.0, 0.5])
    logits = torch.randn(6, 2 * CANDIDATE_TIERS[-1], generator=gen, dtype=torch.float64).float() * scales.unsqueeze(1)
    top_k = torch.zeros(6, dtype=torch.long)
    top_p = torch.tensor([0.9, 0.9, 0.9, 0.95, 0.95, 0.95])
    min_p = torch.zeros(6)
    groups, slow = kept_candidates(logits, top_k, top_p)
    assert [(index.tolist(), values.shape[1]) for index, values, _ in groups] == [([0, 3], 256), ([1, 4], 4096)]
    assert slow.tolist() == [2, 5]
    whole_rows = []
    whole = sampler._whole_row_top_k_top_p
    monkeypatch.setattr(sampler, "_whole_row_top_k_top_p",
                        lambda x, k, p: whole_rows.append(x.shape[0]) or whole(x, k, p))
    got = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    assert whole_rows == [2]
    assert torch.equal(torch.isfinite(got), torch.isfinite(reference(logits, top_k, top_p, min_p)))


def test_whole_rows_keep_what_the_rule_keeps() -> None:
    """Rows past every candidate tier: those with top-p alone by the C++ threshold (no sort), those with a
    top-k too by the sort; flat, peaked, tied and partly -inf rows all keep the rule's set, and a row with a
    NaN or an infinite logit sends the call to the sort."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 6000, generator=gen, dtype=torch.float64).float() * \
        torch.tensor([0.3, 1.0, 2.0, 4.0]).repeat(2).unsqueeze(1)
    logits[1] = (logits[1] * 4).round() / 4
    logits[2, ::3] = float("-inf")
    top_k = torch.tensor([0, 0, 0, 0, 0, 3000, 0, 6000])
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99, 0.999, 0.9, 0.7, 0.8])
    got = sampler._whole_row_top_k_top_p(logits, top_k, top_p)
    want = reference(logits, top_k, top_p, torch.zeros(8))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    special = logits[:2].clone()
    special[0, 7] = float("inf")
    got = sampler._whole_row_top_k_top_p(special, top_k[:2], top_p[:2])
    assert torch.equal(torch.isfinite(got), torch.isfinite(sampler._sort_top_k_top_p(special, top_k[:2], top_p[:2])))


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
        (dict(temperature=1.0, top_p=0.95), 0.7),            # flat: the second candidate tier
        (dict(temperature=1.2), 2.0),                        # no filter: the full vocabulary
    ],
    ids=["top_k_top_p", "top_p_min_p", "top_p_fallback", "plain"],
)
def test_unseeded_rows_sample_the_filtered_distribution(params: dict, scale: float) -> None:
    draws = 3000
    logits = peaked_logits(1, scale, seed=7)
    sp = SamplingParams(max_tokens=1, **params)
    rows = [SamplingRow(sp, [1], [], []) for _ in range(draws)]
    tokens = Sampler(torch.Generator().manual_seed(3))(logits.expand(draws, -1).contiguous(), rows, 0).token_ids
    t = torch.tensor([sp.temperature])
    filtered = reference(logits / t, torch.tensor([sp.top_k]), torch.tensor([sp.top_p]), torch.tensor([sp.min_p]))
    probs = filtered.double().softmax(dim=-1)[0]
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert chi_square_p_value(counts, probs) > P_VALUE_FLOOR


@pytest.mark.parametrize("draw", [categorical, _torch_categorical], ids=["op", "torch"])
def test_categorical_draws_never_land_on_a_zero_probability_entry(draw) -> None:
    """categorical inverts each row's CDF with one uniform (the C++ op on CPU, the torch reference
    elsewhere): rows whose mass sits at either end, rows of equal logits, and the smallest and largest
    uniforms all land on an entry of positive probability (logit above -inf), with the right frequencies."""
    probs = torch.zeros(4, 1000)
    probs[0, -1] = 1.0                               # all mass on the last entry
    probs[1, 0] = 1.0                                # on the first
    probs[2, 10:20] = 0.1                            # ten equal entries
    probs[3, ::7] = torch.rand(143, generator=torch.Generator().manual_seed(1))
    probs[3] /= probs[3].sum()
    logits = probs.log()                             # log 0 = -inf
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([draw(logits, torch.rand(4, dtype=torch.float64, generator=g)) for _ in range(2000)])
    assert (draws[:, 0] == 999).all() and (draws[:, 1] == 0).all()
    assert ((draws[:, 2] >= 10) & (draws[:, 2] < 20)).all()
    assert (probs[3][draws[:, 3]] > 0).all()
    counts = torch.bincount(draws[:, 3], minlength=1000).double()
    assert chi_square_p_value(counts, probs[3].double()) > P_VALUE_FLOOR
    # the smallest and the largest uniform a generator can give: the first and the last positive entry
    assert draw(logits, torch.zeros(4, dtype=torch.float64)).tolist() == [999, 0, 10, 0]
    assert draw(logits, torch.full((4,), 1.0 - 2.0 ** -53, dtype=torch.float64)).tolist() == [999, 0, 19, 994]


def test_categorical_op_draws_what_the_torch_reference_draws() -> None:
    """The same token for the same uniform (they differ only where the uniform falls within rounding of a
    boundary between two tokens' cumulative sums); a NaN row takes its first NaN and a row with +inf its
    first +inf, as argmax does, and a row with nothing kept takes column 0."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 3000, generator=g) * 3
    logits[::3, ::5] = float("-inf")
    u = torch.rand(64, dtype=torch.float64, generator=g)
    assert torch.equal(categorical(logits, u), _torch_categorical(logits, u))
    if not load_cpu_kernels():
        pytest.skip("the C++ op's answers for NaN and infinite rows (the torch reference has none)")
    special = torch.zeros(3, 600)
    special[0, [7, 300]] = float("nan")
    special[1, [5, 599]] = float("inf")
    special[2] = float("-inf")
    assert categorical(special, torch.full((3,), 0.5, dtype=torch.float64)).tolist() == [7, 5, 0]


@pytest.mark.parametrize("shuffle_seed", [0, 1])
def test_ties_at_the_threshold_are_all_kept(shuffle_seed: int) -> None:
    """Top-k keeps every token tied with the k-th logit; top-p keeps every token tied with the last token it
    needs; whatever order the tied tokens sit in the vocabulary, and in the candidate path as in the sort
    (300 tokens tied at the top lie past the 256 candidates)."""
    base = torch.full((VOCAB,), -5.0)
    base[:3] = torch.tensor([6.0, 5.0, 5.0])       # top-k 2: the k-th value 5.0 is tied -> 3 kept
    row_k = base.clone()
    row_p = base.clone()
    row_p[:4] = torch.tensor([2.0, 1.0, 1.0, 1.0])  # top-p 0.5 needs one 1.0 token -> all three kept
    row_wide = base.clone()
    row_wide[:300] = 3.0                            # top-k 10: all 300 tied tokens, past the candidates
    logits = torch.stack([row_k, row_p, row_wide, row_k])
    top_k = torch.tensor([2, 0, 10, 2])
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.99])
    min_p = torch.zeros(4)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(shuffle_seed))
    kept = torch.isfinite(apply_top_k_top_p_min_p(logits[:, perm], top_k, top_p, min_p))
    assert kept.sum(dim=-1).tolist() == [3, 4, 300, 3]
    assert torch.equal(kept, torch.isfinite(reference(logits[:, perm], top_k, top_p, min_p)))


def test_min_p_applies_before_top_p() -> None:
    """min-p first: top-p then renormalizes over what min-p kept (vLLM V1), so it needs fewer tokens."""
    probs = torch.full((VOCAB,), 0.10 / (VOCAB - 3), dtype=torch.float64)
    probs[:3] = torch.tensor([0.32, 0.30, 0.28], dtype=torch.float64)
    logits = probs.log().float().unsqueeze(0)
    # min_p 0.5 keeps the first three (renormalized 0.356, 0.333, 0.311); top_p 0.66 then needs two of them.
    # Top-p first would need three (0.32 + 0.30 < 0.66), and min-p afterwards would keep them.
    got = apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.tensor([0.66]), torch.tensor([0.5]))
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [0, 1]


@pytest.mark.parametrize(
    ("params", "scale"),
    [
        (dict(temperature=0.8, top_k=40, top_p=0.9), 3.0),  # kept set within the candidates
        (dict(temperature=1.0, top_p=0.95), 0.5),            # flat: the full-vocabulary race
        (dict(temperature=1.2), 2.0),                        # no filter
    ],
    ids=["candidates", "full_sort", "plain"],
)
def test_seeded_rows_sample_the_filtered_distribution(params: dict, scale: float) -> None:
    """One draw per seed (and per position) from the same logits: the draws follow the filtered softmax."""
    logits = peaked_logits(1, scale, seed=11)
    rows = [SamplingRow(SamplingParams(max_tokens=1, seed=seed, **params), [1], [], [], output_index=position)
            for seed in range(300) for position in range(10)]
    tokens = seeded_sample(logits.expand(len(rows), -1).contiguous(), rows)
    sp = rows[0].params
    filtered = reference(logits / torch.tensor([sp.temperature]), torch.tensor([sp.top_k]),
                         torch.tensor([sp.top_p]), torch.tensor([sp.min_p]))
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert chi_square_p_value(counts, filtered.double().softmax(dim=-1)[0]) > P_VALUE_FLOOR


def test_seeded_noise_is_per_token_and_the_candidate_race_is_the_full_race() -> None:
    """A token's noise is the same whichever tokens are looked at beside it, so the race over the
    candidates picks what argmax(p / Exp noise) over the whole vocabulary picks (spec verification and
    a draft model's coupled draws use the latter), and the draw changes with seed and position."""
    rows = [SamplingRow(SamplingParams(seed=seed, temperature=0.7, top_p=0.9), [1], [], [], output_index=pos)
            for seed in (0, 1, 2**40 + 3) for pos in (0, 1, 500)]
    vocab = torch.arange(VOCAB).expand(len(rows), VOCAB)
    full = seeded_gumbel(rows, vocab)
    subset = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:50].expand(len(rows), 50)
    assert torch.equal(seeded_gumbel(rows, subset), full.gather(1, subset))
    assert len({tuple(r.tolist()) for r in full[:, :8]}) == len(rows)
    logits = peaked_logits(len(rows), 4.0, seed=5)
    probs = processed_probs(logits, rows)
    noise = exponential_noise(tuple(probs.shape), rows, probs.device, None)
    assert torch.equal(seeded_sample(logits, rows), (probs / noise).argmax(dim=-1))
