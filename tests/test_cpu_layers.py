"""The decoder's fused C++ CPU ops (pagedllm/layers/csrc/cpu_layers.cpp) against the torch code they replace.

bf16 and fp16 results must be bitwise equal to the torch path (same roundings in the same places), so a
model's outputs do not depend on whether the kernels built; fp32 RMSNorm may differ in the last bits
(the order of the sum of squares), nothing else.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from pagedllm.cpu_kernels import load_cpu_kernels
from pagedllm.layers.norm import RMSNorm, torch_rms_norm
from pagedllm.layers.rotary import _apply
from pagedllm.layers.sampler import argmax_rows

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ CPU kernels did not build")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_with_ties_nan_and_inf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 1000).to(dtype)
    x[1, 10] = x[1, 500] = 100.0                            # a tie: the first index wins
    x[2, 7] = x[2, 900] = float("nan")                      # NaN counts as the largest, the first one wins
    x[3, 999] = float("inf")
    x[4] = float("-inf")                                    # nothing above -inf: index 0
    x[5, 3] = float("inf")
    x[5, 4] = float("nan")
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    # the runner takes a plain-greedy step's argmax on the logits as the matmul made them (bf16)
    assert torch.equal(got, argmax_rows(x.float()))
    assert argmax_rows(x[:0]).shape == (0,)
    odd = torch.randn(3, 77).to(dtype)                      # a width that is no multiple of the chunk
    assert torch.equal(argmax_rows(odd), odd.argmax(dim=-1))
    # widths around the SIMD vector and the 256-wide chunk, maxima and NaNs in the scalar tails
    for width in (1, 15, 16, 17, 31, 32, 33, 255, 256, 257, 8192 + 5):
        rows = torch.randn(6, width).round().to(dtype)       # rounded: many ties
        rows[1, -1] = 50.0
        rows[2, -1] = float("nan")
        rows[3, width // 2] = float("nan")
        rows[3, -1] = float("inf")
        rows[4, 0] = rows[4, -1] = 60.0
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1)), width
    # +0 and -0 are equal maxima (bf16 and fp16 rows are compared as integer keys, which must keep them equal)
    zeros = -torch.rand(6, 3000).round()
    zeros[:, ::3] = -0.0
    zeros[1, 2000] = 0.0
    zeros[2, 1500:] = 0.0
    zeros[3] = -0.0
    zeros = zeros.to(dtype)
    assert torch.equal(argmax_rows(zeros), zeros.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_the_torch_path(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(96, 1e-6, dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, residual = torch.randn(13, 96).to(dtype), torch.randn(13, 96).to(dtype)
    want_residual = x + residual
    want = torch_rms_norm(want_residual, norm.weight, norm.eps)
    out, new_residual = norm(x.clone(), residual.clone())
    assert torch.equal(new_residual, want_residual)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_residual_matches_the_torch_path(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    norm = RMSNorm(96, 1e-6, dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    wide = torch.randn(13, 160).to(dtype)
    for x in (wide[:, :96].contiguous(), wide[:, 32:128]):    # packed rows, and strided ones
        before = x.clone()
        want = torch_rms_norm(x, norm.weight, norm.eps)
        out = norm(x)
        assert torch.equal(x, before), "the input is not touched"
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out, want)
        assert torch.equal(norm(x[:1]), out[:1]), "a row does not depend on the batch"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_in_place_on_strided_views(dtype: torch.dtype) -> None:
    # q and k are views of a fused qkv output, as in the model; v must not be touched.
    torch.manual_seed(2)
    qkv = torch.randn(11, (4 + 2 + 2) * 64).to(dtype)
    q, k = qkv[:, :256].reshape(-1, 4, 64), qkv[:, 256:384].reshape(-1, 2, 64)
    cos, sin = torch.randn(11, 1, 64).to(dtype), torch.randn(11, 1, 64).to(dtype)
    want_q, want_k, v = _apply(q, cos, sin), _apply(k, cos, sin), qkv[:, 384:].clone()
    torch.ops.pagedllm_cpu_layers.rotary_embedding(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, 384:], v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    # Its exp is a polynomial, not torch's: fp32 may differ in the last bits, and then a 16-bit result
    # by one unit in the last place, rarely.
    torch.manual_seed(3)
    gate_up = (torch.randn(37, 2 * 300) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])   # exp over- and underflow, zeros
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = torch.ops.pagedllm_cpu_layers.silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    if dtype != torch.float32:
        assert (got != want).float().mean() < 0.01


def test_step_inputs_op_matches_the_array_path() -> None:
    """ModelRunner.prepare's flat inputs from one C++ call equal the numpy path's, for decodes, speculative
    verification widths and prefill chunks mixed in one step, any block size, with and without zeroing;
    and a decode step's, built from an input batch's token rows and counts (decode_step_inputs), equal
    them too."""
    import numpy as np

    from pagedllm.worker.step_inputs import decode_step_inputs, step_inputs, step_inputs_numpy

    rng = random.Random(0)
    decoded_here = 0
    for _ in range(300):
        bs = rng.choice([1, 2, 16, 32])
        table = np.array([[rng.randrange(1000) for _ in range(40)] for _ in range(20)], dtype=np.int64)
        num_reqs = rng.randrange(1, 12)
        rows = rng.sample(range(20), num_reqs)
        query_lens = [rng.choice([1, 1, 2, 5, 30]) for _ in range(num_reqs)] if rng.random() < 0.7 \
            else [1] * num_reqs
        start_pos = [rng.randrange(0, 40 * bs - q + 1) for q in query_lens]
        token_ids = [rng.randrange(50_000) for _ in range(sum(query_lens))]
        for zero_pad in (False, True):
            got = step_inputs(token_ids, start_pos, query_lens, rows, torch.from_numpy(table.copy()), bs, zero_pad)
            want = step_inputs_numpy(token_ids, start_pos, query_lens, rows, table.copy(), bs, zero_pad)
            for name, a, b in zip(want._fields[:6], got, want):
                assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name
            assert (got.max_query_len, got.max_seq_len) == (want.max_query_len, want.max_seq_len) \
                == (max(query_lens), max(p + q for p, q in zip(start_pos, query_lens)))
            if set(query_lens) == {1}:  # a decode step, also from an input batch's token rows and counts
                token_table = np.zeros((20, 40 * bs), dtype=np.int64)
                num_tokens = np.zeros(20, dtype=np.int64)
                token_table[rows, start_pos] = token_ids
                num_tokens[rows] = np.array(start_pos) + 1
                for use_op in (True, False):  # the C++ op and the numpy path it stands in for
                    # the last tokens already in the rows, or appended by the same call (new_tokens)
                    for appended in (False, True):
                        tokens, counts = token_table.copy(), num_tokens.copy()
                        if appended:
                            counts[rows] -= 1
                        with mock.patch("pagedllm.worker.step_inputs.load_cpu_kernels", lambda use_op=use_op: use_op):
                            decoded = decode_step_inputs(
                                torch.from_numpy(tokens), torch.from_numpy(counts), torch.tensor(rows),
                                torch.from_numpy(table.copy()), bs, zero_pad,
                                torch.tensor(token_ids) if appended else None)
                        assert all(torch.equal(a, b) for a, b in zip(decoded[:6], want[:6]))
                        assert decoded[6:] == want[6:]
                        assert np.array_equal(tokens, token_table) and np.array_equal(counts, num_tokens)
                decoded_here += 1
    assert decoded_here > 50


def test_append_tokens_op_matches_the_array_path() -> None:
    """A decode step's sampled tokens, appended to an input batch's rows by the C++ op and by numpy alike."""
    import numpy as np

    from pagedllm.worker.step_inputs import append_tokens

    rng = random.Random(1)
    for _ in range(50):
        counts = np.array([rng.randrange(0, 15) for _ in range(12)], dtype=np.int64)
        rows = rng.sample(range(12), rng.randrange(1, 12))
        token_ids = [rng.randrange(50_000) for _ in rows]
        results = []
        for use_op in (True, False):
            table, num_tokens = np.zeros((12, 16), dtype=np.int64), counts.copy()
            with mock.patch("pagedllm.worker.step_inputs.load_cpu_kernels", lambda use_op=use_op: use_op):
                append_tokens(torch.from_numpy(table), torch.from_numpy(num_tokens), torch.tensor(rows),
                              torch.tensor(token_ids))
            assert num_tokens[rows].tolist() == (counts[rows] + 1).tolist()
            assert table[rows, counts[rows]].tolist() == token_ids
            results.append((table, num_tokens))
        assert all(np.array_equal(a, b) for a, b in zip(*results))


def test_kernel_build_reads_copies_of_the_sources_inside_its_content_keyed_directory(tmp_path) -> None:
    """Two installs of one version build from the same paths (ninja records them), so neither rebuilds
    the other's build; copying again leaves unchanged files untouched (their mtimes are what ninja checks)."""
    import os

    from pagedllm import cpu_kernels

    sources, include = cpu_kernels._copy_sources(str(tmp_path))
    assert all(path.startswith(str(tmp_path)) for path in [*sources, include])
    for original, copy in zip(cpu_kernels._SOURCES, sources):
        assert open(original, "rb").read() == open(copy, "rb").read()
    assert sorted(os.listdir(include)) == sorted(os.listdir(cpu_kernels._INCLUDE))
    mtimes = [os.stat(path).st_mtime_ns for path in sources]
    assert cpu_kernels._copy_sources(str(tmp_path)) == (sources, include)
    assert [os.stat(path).st_mtime_ns for path in sources] == mtimes
