"""The sampler's C++ ops (layers/csrc/sampler_ops.cpp) against their torch twins: the seeded Gumbel race
picks the same column on every row, whatever the logits' shape (peaked, flat, ties, removed tokens, NaN
and infinities), seed, position or token ids; the top candidates are torch.topk's values with the same
columns per value. So a seeded request's tokens do not depend on whether the kernels built."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.cpu_kernels import load_cpu_kernels
from pagedllm.layers.sampler import (
    SamplingRow,
    _torch_logprob_stats,
    _torch_seeded_race,
    _torch_top_candidates,
    logprob_stats,
    position_keys,
    row_logsumexp,
    seeded_race,
    seeded_sample,
    top_candidates,
)

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ CPU kernels did not build")


def cpp_race(values: torch.Tensor, ids: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    return torch.ops.pagedllm_cpu_sampler.seeded_race(values, ids, keys)


def keys_of(num_rows: int, seed: int) -> torch.Tensor:
    rows = [SamplingRow(SamplingParams(seed=seed + i % 7, temperature=0.7), [], [], [], output_index=i * 13)
            for i in range(num_rows)]
    return position_keys(rows, torch.device("cpu"))


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0, 60.0])
def test_full_rows_pick_the_reference_column(scale: float) -> None:
    """600 rows per scale, flat (many tokens can win) to peaked (one can), over a large vocabulary."""
    gen = torch.Generator().manual_seed(int(scale * 10))
    values = torch.randn(600, 3000, generator=gen) * scale
    keys = keys_of(600, seed=int(scale))
    got = cpp_race(values, None, keys)
    assert torch.equal(got, _torch_seeded_race(values, None, keys))
    assert len(set(got.tolist())) > 1  # the noise does decide


@pytest.mark.parametrize("offset", [-1000.0, 700.0, 1020.0, 3e4])
def test_large_logits_keep_the_bound_exact(offset: float) -> None:
    """Logits far from 0 (the float pass loses precision in v - B there; beyond 1024 a double pass runs)."""
    gen = torch.Generator().manual_seed(int(offset) % 1000)
    values = torch.randn(300, 2000, generator=gen) * 0.5 + offset
    keys = keys_of(300, seed=17)
    assert torch.equal(cpp_race(values, None, keys), _torch_seeded_race(values, None, keys))


def test_candidate_rows_with_token_ids_removed_tokens_and_ties() -> None:
    gen = torch.Generator().manual_seed(3)
    values = (torch.randn(400, 256, generator=gen) * 2).sort(dim=-1, descending=True).values
    values[:, 40:] = float("-inf")                               # a top-k/top-p filter's removed tail
    values[::3, 1] = values[::3, 0]                              # tied best logits
    values[::5] = values[::5].round()                            # many exact ties
    ids = torch.stack([torch.randperm(49152, generator=gen)[:256] for _ in range(400)])
    keys = keys_of(400, seed=99)
    assert torch.equal(cpp_race(values, ids, keys), _torch_seeded_race(values, ids, keys))


def test_special_rows_match_torch_argmax() -> None:
    """Nothing kept (column 0), a NaN (the first one), +inf (the first one), one kept token, huge logits."""
    values = torch.randn(6, 500)
    values[0] = float("-inf")
    values[1, 7] = values[1, 300] = float("nan")
    values[2, 11] = values[2, 400] = float("inf")
    values[3] = float("-inf")
    values[3, 123] = 1.0
    values[4] *= 5e3
    values[5] = values[5] * 1e-3 - 2e4
    keys = keys_of(6, seed=5)
    assert torch.equal(cpp_race(values, None, keys), _torch_seeded_race(values, None, keys))
    assert cpp_race(values, None, keys)[:4].tolist() == [0, 7, 11, 123]


def test_seeded_sample_is_the_same_with_and_without_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the sampler, temperature only (whole rows) and with top-p (candidates), many seeds and
    positions: the C++ race and the torch twin choose the same tokens."""
    from pagedllm.layers import sampler

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(64, 4096, generator=gen) * 4
    rows = [SamplingRow(SamplingParams(seed=seed, temperature=t, top_p=p), [], [], [], output_index=pos)
            for seed, pos, t, p in zip(range(64), range(0, 640, 10), [0.7, 1.0, 1.3, 0.5] * 16, [1.0, 0.9] * 32)]
    with_op = seeded_sample(logits, rows)
    monkeypatch.setattr(sampler, "_cpu_seeded_race", _torch_seeded_race)
    monkeypatch.setattr(sampler, "_cpu_top_candidates", _torch_top_candidates)
    assert torch.equal(seeded_sample(logits, rows), with_op)
    assert torch.equal(seeded_race(logits, None, keys_of(64, 1)), _torch_seeded_race(logits, None, keys_of(64, 1)))


def assert_top_candidates_are_topk(x: torch.Tensor, c: int) -> None:
    """top_candidates' values are torch.topk's, and each value's columns the same set (a tie at the last
    value may keep other columns of it)."""
    got_values, got_ids = top_candidates(x, c)
    values, ids = x.topk(c, dim=-1)
    assert torch.equal(got_values, values)
    assert torch.equal(x.gather(1, got_ids), got_values)
    for row in range(x.shape[0]):
        last = values[row, -1]
        assert set(got_ids[row][values[row] > last].tolist()) == set(ids[row][values[row] > last].tolist())
        assert len(set(got_ids[row].tolist())) == c


@pytest.mark.parametrize("c", [1, 7, 256, 1000])
def test_top_candidates_are_torch_topk_values(c: int) -> None:
    """Peaked, flat, rounded (many ties), removed (-inf) and signed-zero rows: the values equal torch.topk's
    and each value's columns are the same set."""
    gen = torch.Generator().manual_seed(c)
    x = torch.randn(40, 1000, generator=gen) * torch.tensor([0.1, 1.0, 5.0, 40.0]).repeat(10).unsqueeze(1)
    x[1::4] = x[1::4].round()
    x[2::4, 500:] = float("-inf")
    x[3, :300] = 0.0
    x[3, 300:600] = -0.0
    x[5, 9] = float("inf")
    assert_top_candidates_are_topk(x, c)


@pytest.mark.parametrize("c", [20, 256])
def test_top_candidates_of_long_rows_are_torch_topk_values(c: int) -> None:
    """Rows of 8 c or more go through a threshold estimated on a strided sample (and back to the histogram
    where too few values reach it, as in the last row here, whose largest values are exactly the sampled
    columns): the same values as torch.topk, each value's columns the same set."""
    gen = torch.Generator().manual_seed(c)
    x = torch.randn(8, 8192, generator=gen) * torch.tensor([0.1, 1.0, 5.0, 40.0]).repeat(2).unsqueeze(1)
    x[1] = x[1].round()
    x[2, 4000:] = float("-inf")
    x[3, :3000] = 0.0
    x[3, 3000:6000] = -0.0
    x[5, 9] = float("inf")
    x[7] = -1000.0
    x[7, ::4] = torch.randn(2048, generator=gen)
    assert_top_candidates_are_topk(x, c)


def test_row_logsumexp_is_torchs() -> None:
    """The C++ op (two passes, float64 sums of fast_exp) within a few float32 ulps of torch's logsumexp,
    and the same NaN, +inf and all -inf rows."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 5000, generator=gen) * torch.tensor([0.1, 3.0, 30.0]).repeat(4).unsqueeze(1)
    x[4, ::3] = float("-inf")
    got, want = row_logsumexp(x), x.logsumexp(dim=-1)
    assert torch.allclose(got, want, rtol=4e-7, atol=0)
    special = torch.zeros(3, 700)
    special[0, 9] = float("nan")
    special[1, 600] = float("inf")
    special[2] = float("-inf")
    assert torch.equal(row_logsumexp(special).isnan(), special.logsumexp(dim=-1).isnan())
    assert row_logsumexp(special)[1:].tolist() == [float("inf"), float("-inf")]


@pytest.mark.parametrize("k", [0, 1, 5, 40])
def test_logprob_stats_are_log_softmaxs(k: int) -> None:
    """The chosen token's log-probability, its rank and the k best, from the C++ op: within a float32
    rounding of float64 log_softmax, the ranks and top tokens as torch's reference gives them (untied float
    logits), for the argmax, a middling token and the last; rows with a NaN or an infinity take torch's way
    whole."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(9, 3000, generator=gen) * torch.tensor([0.5, 4.0, 20.0]).repeat(3).unsqueeze(1)
    x[2, ::7] = float("-inf")
    tokens = torch.cat([x[:3].argmax(dim=-1), torch.tensor([5, 1500, 2999]), x[6:].argmin(dim=-1)])
    chosen, top_lp, top_ids, ranks = logprob_stats(x, tokens, k)
    want_chosen, want_lp, want_ids, want_ranks = _torch_logprob_stats(x, tokens, k)
    exact = x.double().log_softmax(dim=-1)
    assert torch.allclose(chosen.double(), exact.gather(1, tokens.unsqueeze(1)).squeeze(1), rtol=1e-6, atol=2e-6)
    assert torch.equal(ranks, want_ranks)
    assert torch.equal(top_ids, want_ids)
    assert torch.allclose(top_lp.double(), exact.gather(1, top_ids), rtol=1e-6, atol=2e-6)
    special = x[:3].clone()
    special[0, 3] = float("nan")
    special[1, 9] = float("inf")
    special[2] = float("-inf")
    got, want = logprob_stats(special, tokens[:3], k), _torch_logprob_stats(special, tokens[:3], k)
    for a, b in zip(got, want):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())


def test_top_candidates_with_nan_are_torch_topk() -> None:
    x = torch.randn(3, 500)
    x[1, 17] = float("nan")
    got_values, got_ids = top_candidates(x, 10)
    values, ids = x.topk(10, dim=-1)
    assert torch.equal(got_ids, ids) and torch.equal(got_values.isnan(), values.isnan())
