"""Paged attention kernels against a naive float64 reference.

Every kernel (the C++ CPU kernel, the pure-torch tiled recurrence, the Triton kernels under the
interpreter) gets the same random steps: random block tables over a shuffled pool with some blocks
shared between sequences (as prefix caching shares them), contexts from 1 to 4,096 tokens, block
sizes 16 and 32, GQA ratios 1, 4 and 8, and queries per sequence from 1 (decode) through 2-8
(speculative verification, bottom-right causal) to whole prefill chunks with and without a cached
prefix. Tolerances, against float64 on the same (rounded) inputs: 2e-5 for fp32 (summation order),
and for bf16 the output's own rounding (half an ulp is 2^-9 relative) plus fp32 accumulation, i.e.
atol 2e-2 / rtol 1e-2.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedllm.attention import cpu_flash
from pagedllm.attention.torch_flash import TorchFlashAttention, paged_flash_attention

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


def naive_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=None,
                    logits_soft_cap=None):
    """Gather each sequence's context block by block, full softmax in float64, bottom-right causal;
    with a sliding window a query at p sees keys p - window + 1 .. p; soft-capping before the mask."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, _, block_size, _ = kv_cache.shape[1:]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens.tolist()):
        a, b = query_start_loc[i].item(), query_start_loc[i + 1].item()
        blocks = block_tables[i, :-(-seq_len // block_size)]
        k = kv_cache[0][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :seq_len].double()
        v = kv_cache[1][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :seq_len].double()
        group = num_heads // num_kv_heads
        # Keys outside the window may be poison (NaN, see poison_outside_window): masked, they count 0.
        k, v = k.nan_to_num().repeat_interleave(group, 0), v.nan_to_num().repeat_interleave(group, 0)
        scores = query[a:b].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - (b - a), seq_len)
        hidden = torch.arange(seq_len)[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= torch.arange(seq_len)[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def random_step(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim, dtype, seed,
                cache_dtype=None):
    """Query, a KV pool and block tables for one step; sequences 0 and 1 share their first block."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = torch.zeros(len(seq_lens), max(blocks_needed), dtype=torch.long)
    for i, count in enumerate(blocks_needed):
        tables[i, :count] = torch.tensor([pool.pop() for _ in range(count)])
    if len(seq_lens) > 1 and seq_lens[0] > block_size and seq_lens[1] > block_size:
        tables[1, 0] = tables[0, 0]
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(cache_dtype or dtype)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    return query, kv_cache, tables, torch.tensor(seq_lens), query_start_loc


# (context lengths, query lengths): decode, verification, prefill with and without a cached prefix,
# and a mixed step; contexts span 1..4096 and cross the 512-token split length.
STEPS = [
    ([1, 17, 513, 4096], [1, 1, 1, 1]),
    ([9, 700, 2000], [2, 5, 8]),
    ([300, 1200], [300, 70]),
    ([33, 1537, 64, 1000], [1, 8, 64, 3]),
    ([1000, 515], [44, 30]),  # query rows start mid-block: the diagonal blocks are partly visible
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 7, 8])
def test_cpu_kernels_match_naive(dtype: torch.dtype, block_size: int, group: int) -> None:
    for n, (seq_lens, query_lens) in enumerate(STEPS):
        step = random_step(seq_lens, query_lens, block_size, 2, group, 64, dtype, seed=n + 10 * group)
        scale = 64 ** -0.5
        expected = naive_attention(*step, scale)
        torch.testing.assert_close(cpu_flash.paged_attention(*step, scale).double(), expected, **TOL[dtype])
        torch.testing.assert_close(paged_flash_attention(*step, scale, tile_tokens=256).double(), expected,
                                   **TOL[dtype])


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_bf16_decode_matches_naive_at_other_head_sizes(head_dim: int) -> None:
    """Decode's bf16 path (dot products and P @ V in pairs of bf16, 8 query rows a pass; on AMX tiles, 8 or
    16 lanes a key) for every head size it takes (a multiple of 32), with 7 and 12 query rows per KV head
    (a partial pass, and a full one plus a partial one; 8 and 16 lanes)."""
    for group in (7, 12):
        step = random_step([1, 17, 513, 2100], [1, 1, 1, 1], 16, 2, group, head_dim, torch.bfloat16,
                           seed=head_dim + group)
        scale = head_dim ** -0.5
        torch.testing.assert_close(cpu_flash.paged_attention(*step, scale).double(), naive_attention(*step, scale),
                                   **TOL[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_bf16_prefill_matches_naive_at_other_head_sizes(head_dim: int) -> None:
    """Prefill chunks of a bf16 cache (on AMX tiles where the CPU has them: transposed scores and P V by the
    tiles, 16 query rows a tile, the last one partly filled) for every head size that path takes, fresh and
    after a cached prefix, with a last block partly filled and 1 to 7 query rows per KV head."""
    for group in (1, 7):
        step = random_step([40, 300, 129], [40, 37, 64], 16, 2, group, head_dim, torch.bfloat16,
                           seed=head_dim + group)
        scale = head_dim ** -0.5
        torch.testing.assert_close(cpu_flash.paged_attention(*step, scale).double(), naive_attention(*step, scale),
                                   **TOL[torch.bfloat16])


def poison_outside_window(step, sliding_window):
    """The step with every block wholly before its first query's window replaced by a block of NaNs:
    a kernel that reads such a block (a sliding layer's freed block) instead of skipping it gives NaN."""
    query, kv_cache, tables, seq_lens, starts = step
    block_size = kv_cache.shape[3]
    kv_cache = torch.cat([kv_cache, torch.full_like(kv_cache[:, :, :1], float("nan"))], dim=2)
    tables = tables.clone()
    for i, seq_len in enumerate(seq_lens.tolist()):
        first_query = seq_len - (starts[i + 1] - starts[i]).item()
        tables[i, :max(0, first_query - sliding_window + 1) // block_size] = kv_cache.shape[2] - 1
    return query, kv_cache, tables, seq_lens, starts


# (window, soft cap): windows smaller than, about, and larger than a block and a 512-token split.
WINDOWS = [(1, None), (7, None), (40, 30.0), (600, None), (None, 5.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_sliding_window_and_soft_cap_match_naive(dtype: torch.dtype, block_size: int, group: int) -> None:
    for n, (seq_lens, query_lens) in enumerate(STEPS):
        for window, cap in WINDOWS:
            step = random_step(seq_lens, query_lens, block_size, 2, group, 64, dtype, seed=n + 10 * group)
            if window is not None:
                step = poison_outside_window(step, window)
            scale = 64 ** -0.5
            expected = naive_attention(*step, scale, sliding_window=window, logits_soft_cap=cap)
            got = cpu_flash.paged_attention(*step, scale, sliding_window=window, logits_soft_cap=cap)
            torch.testing.assert_close(got.double(), expected, **TOL[dtype])
            got = paged_flash_attention(*step, scale, tile_tokens=256, sliding_window=window, logits_soft_cap=cap)
            torch.testing.assert_close(got.double(), expected, **TOL[dtype])


def test_reference_backend_takes_window_and_soft_cap() -> None:
    # TORCH_SDPA's own path for windowed / capped layers, through the backend interface.
    from pagedllm.attention.backend import AttentionMetadata
    from pagedllm.attention.torch_paged import TorchPagedAttention

    backend = TorchPagedAttention(8, 2, 64, torch.float32)
    backend.configure_kv_cache(torch.float32)
    for n, (seq_lens, query_lens) in enumerate(STEPS):
        for window, cap in WINDOWS:
            step = random_step(seq_lens, query_lens, 16, 2, 4, 64, torch.float32, seed=n)
            if window is not None:
                step = poison_outside_window(step, window)
            query, kv_cache, tables, lens, starts = step
            metadata = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), query_start_loc=starts,
                                         seq_lens=lens, block_tables=tables)
            empty = torch.empty(0, 2, 64)
            got = backend.forward(query, empty, empty, kv_cache, metadata, 0.125, window, cap)
            expected = naive_attention(*step, 0.125, sliding_window=window, logits_soft_cap=cap)
            torch.testing.assert_close(got.double(), expected, **TOL[torch.float32])


def test_cpu_kernel_is_compiled_here() -> None:
    # The machine running the tests has a compiler: the fallback must not hide a broken build.
    assert cpu_flash.load_cpu_kernels()


def test_decode_path_follows_the_cpu_flags() -> None:
    # -march=native: a Xeon with AMX gets the tiles, a CPU with AVX512-BF16 (Zen 4) the bf16 dot products,
    # one with AVX-512 only the fp32 path, any other the compiler-vectorised loops.
    from pagedllm.platform import _cpu_flags

    path = cpu_flash.decode_path()  # (loads the kernels)
    flags = _cpu_flags()
    # the tiles also need Linux to grant the process their state (arch_prctl), which the linear op reports
    amx = ({"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"} <= flags
           and bool(torch.ops.pagedllm_cpu_linear.blocked_linear_supports(torch.bfloat16, True)))
    expected = ("amx_bf16" if amx else "avx512_bf16" if "avx512_bf16" in flags
                else "avx512" if "avx512f" in flags else "generic")
    assert path == expected


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_kernel_reads_half_and_fp8_caches(cache_dtype: torch.dtype) -> None:
    step = random_step([40, 700], [1, 4], 16, 2, 4, 128, torch.bfloat16, seed=3, cache_dtype=cache_dtype)
    expected = naive_attention(*step, 0.1)  # reads the same stored values, widened to float64
    torch.testing.assert_close(cpu_flash.paged_attention(*step, 0.1).double(), expected, **TOL[torch.bfloat16])


def test_fp32_query_over_a_bf16_cache() -> None:
    # The decode path widens bf16 K/V rows in registers for an fp32 query (no bf16 dot products: the
    # query would be rounded); decode and verification rows over contexts past a split.
    step = random_step([700, 1500], [1, 3], 16, 2, 4, 64, torch.float32, seed=4, cache_dtype=torch.bfloat16)
    expected = naive_attention(*step, 0.125)
    torch.testing.assert_close(cpu_flash.paged_attention(*step, 0.125).double(), expected, atol=1e-4, rtol=1e-4)


def test_split_kv_result_does_not_depend_on_batch() -> None:
    # The split length is fixed: a sequence's output is bitwise the same alone or next to others.
    query, kv_cache, tables, seq_lens, starts = random_step([3000, 2000], [1, 1], 16, 2, 4, 64, torch.float32, 5)
    together = cpu_flash.paged_attention(query, kv_cache, tables, seq_lens, starts, 0.125)
    alone = cpu_flash.paged_attention(query[:1], kv_cache, tables[:1], seq_lens[:1], starts[:2], 0.125)
    assert torch.equal(together[:1], alone)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_write_kv_fills_the_slots(cache_dtype: torch.dtype) -> None:
    num_kv_heads, num_blocks, block_size, head_dim = 2, 6, 4, 8
    key = torch.randn(5, num_kv_heads, head_dim)
    value = torch.randn(5, num_kv_heads, head_dim)
    slots = torch.tensor([0, 7, 9, 22, 13])
    expected = torch.zeros(2, num_kv_heads, num_blocks * block_size, head_dim)
    expected[0][:, slots] = key.transpose(0, 1).to(cache_dtype).float()
    expected[1][:, slots] = value.transpose(0, 1).to(cache_dtype).float()
    # The torch write every backend inherits, and the C++ one of CPU_FLASH.
    for backend in (TorchFlashAttention(4, 2, head_dim, torch.float32),
                    cpu_flash.CpuFlashAttention(4, 2, head_dim, torch.float32)):
        cache = torch.zeros(2, num_kv_heads, num_blocks, block_size, head_dim).to(cache_dtype)
        backend.write_kv(cache, key, value, slots)
        assert torch.equal(cache.float().view(expected.shape), expected)


def test_torch_fallback_when_the_kernel_is_disabled() -> None:
    code = textwrap.dedent("""
        import torch
        from pagedllm.attention import cpu_flash
        assert not cpu_flash.load_cpu_kernels()
        backend = cpu_flash.CpuFlashAttention(4, 2, 8, torch.float32)
        assert not backend.use_kernel
        print("fallback ok")
    """)
    env = dict(os.environ, PAGEDLLM_DISABLE_CPU_KERNELS="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "fallback ok" in result.stdout, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("path,num_tokens,budget", [("kernel", 16384, 64 * 2**20), ("torch", 8192, 160 * 2**20)])
def test_prefill_peak_memory_is_far_below_the_score_matrix(path: str, num_tokens: int, budget: int) -> None:
    # One long prefill (no cached prefix, 2 query heads over 1 KV head): its N x N fp32 score matrix
    # would be N^2 * 4 bytes * 2 heads, 2 GiB at N = 16,384. Peak resident memory of a fresh process
    # may grow during the call by at most: 64 MiB for the C++ kernel at 16k tokens (it holds a
    # 16-query x block tile per thread); 160 MiB, under a third of N x N, for the pure-torch path at
    # 8k tokens (a few [2, 8192, 512] fp32 tiles of 32 MiB; 16k is too slow for the suite there).
    # Run in a subprocess so ru_maxrss belongs to this call alone.
    code = textwrap.dedent("""
        import resource, torch
        from pagedllm.attention import cpu_flash
        n, bs = NUM_TOKENS, 16
        q = torch.randn(n, 2, 64)
        cache = torch.randn(2, 1, n // bs, bs, 64)
        tables = torch.arange(n // bs).view(1, -1)
        out = torch.empty_like(q)
        lens, starts = torch.tensor([n]), torch.tensor([0, n])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu_flash.paged_attention(q, cache, tables, lens, starts, 0.125, out=out)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        assert torch.isfinite(out).all()
        print("KERNEL", cpu_flash.load_cpu_kernels(), "GROWN", grown)
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", PAGEDLLM_DISABLE_CPU_KERNELS="1" if path == "torch" else "0")
    code = code.replace("NUM_TOKENS", str(num_tokens))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("KERNEL")]
    assert lines, result.stderr
    assert lines[0][1] == str(path == "kernel")
    grown = int(lines[0][3])
    assert grown < budget < num_tokens ** 2 * 4 * 2 / 3, f"peak memory grew by {grown / 2**20:.0f} MiB"


def _run_triton(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_triton_kernels_match_naive_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    # The interpreter is slow: tiny heads and a few hundred tokens, still crossing the split length.
    code = textwrap.dedent("""
        import torch, sys
        sys.path.insert(0, TESTS_DIR)
        from test_attention_kernels import naive_attention, poison_outside_window, random_step, TOL
        from pagedllm.attention.triton_paged import paged_attention_decode, paged_attention_varlen
        for dtype, block_size, group in [(torch.float32, 16, 4), (torch.bfloat16, 32, 1), (torch.float32, 32, 8)]:
            for seq_lens, query_lens in [([1, 40, 530], [1, 1, 1]), ([9, 100, 70], [2, 8, 70])]:
                step = random_step(seq_lens, query_lens, block_size, 1, group, 16, dtype, seed=block_size)
                expected = naive_attention(*step, 0.25)
                got = paged_attention_varlen(*step, 0.25)
                torch.testing.assert_close(got.double(), expected, **TOL[dtype])
                if max(query_lens) == 1:
                    query, cache, tables, lens, _ = step
                    got = paged_attention_decode(query, cache, tables, lens, max(seq_lens), 0.25)
                    torch.testing.assert_close(got.double(), expected, **TOL[dtype])
        # Sliding windows (blocks before them poisoned with NaN: never read) and soft-capping.
        for seq_lens, query_lens in [([1, 40, 530], [1, 1, 1]), ([9, 100, 70], [2, 8, 70])]:
            for window, cap in [(7, None), (40, 5.0), (None, 5.0)]:
                step = random_step(seq_lens, query_lens, 16, 1, 4, 16, torch.float32, seed=1)
                if window is not None:
                    step = poison_outside_window(step, window)
                expected = naive_attention(*step, 0.25, sliding_window=window, logits_soft_cap=cap)
                got = paged_attention_varlen(*step, 0.25, sliding_window=window, logits_soft_cap=cap)
                torch.testing.assert_close(got.double(), expected, **TOL[torch.float32])
                if max(query_lens) == 1:
                    query, cache, tables, lens, _ = step
                    got = paged_attention_decode(query, cache, tables, lens, max(seq_lens), 0.25,
                                                 sliding_window=window, logits_soft_cap=cap)
                    torch.testing.assert_close(got.double(), expected, **TOL[torch.float32])
        print("triton ok")
    """)
    result = _run_triton(code.replace("TESTS_DIR", repr(os.path.dirname(os.path.abspath(__file__)))))
    assert "triton ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_result_does_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    # The kernels run on torch's OpenMP pool (built with -fopenmp): work items and flash-decoding splits
    # are fixed by the step, not by the threads, so two threads give bitwise what one does.
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append([cpu_flash.paged_attention(*random_step(seq_lens, query_lens, 16, 2, 4, 64, dtype,
                                                                   seed=n), 0.125)
                            for n, (seq_lens, query_lens) in enumerate(STEPS)])
    finally:
        torch.set_num_threads(threads)
    for other in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outputs[0], other))


# A row's keys in every item that may hold it: bf16 on the AMX tiles where the CPU has them; fp32, fp16 and
# one-byte caches on the vector or the scalar path; contexts that cross the 512-token split boundary
# (folded inside a prefill item, merged after a decode's split items); a window, a soft cap, 32- and
# 8-token blocks.
ROW_CASES = [
    (torch.float32, 16, 2, 16, 73, {}),
    (torch.bfloat16, 64, 2, 16, 73, {}),
    (torch.bfloat16, 64, 7, 16, 73, {}),
    (torch.bfloat16, 64, 2, 16, 1100, {}),
    (torch.float32, 64, 4, 32, 700, {"sliding_window": 37}),
    (torch.bfloat16, 32, 4, 16, 300, {"logits_soft_cap": 5.0}),
    (torch.float16, 24, 2, 8, 90, {}),
    (torch.bfloat16, 64, 7, 16, 600, {"cache": torch.int8}),
]


@pytest.mark.parametrize("dtype,head_dim,group,block_size,length,options", ROW_CASES)
def test_a_row_does_not_depend_on_the_chunk_that_holds_it(dtype: torch.dtype, head_dim: int, group: int,
                                                          block_size: int, length: int, options: dict) -> None:
    """One sequence's query positions attended at once, a position at a time and in chunks of 7 and 33 (as
    chunked prefill, decode and a preempted request's recomputation see them): bitwise the same rows, so
    no near-tie token depends on how the scheduler cut the sequence."""
    assert cpu_flash.load_cpu_kernels()
    options = dict(options)
    cache_dtype = options.pop("cache", None)
    query, kv_cache, tables, seq_lens, starts = random_step([length], [length], block_size, 2, group, head_dim,
                                                            dtype, seed=3)
    scales = None
    if cache_dtype is not None:  # random codes and per-row bf16 scales, as kv_cache/quant.py stores them
        gen = torch.Generator().manual_seed(4)
        kv_cache = torch.randint(-127, 128, kv_cache.shape, generator=gen, dtype=torch.int8)
        scales = (torch.rand(kv_cache.shape[:4], generator=gen) / 64).to(torch.bfloat16)
    scale = head_dim ** -0.5
    window, soft_cap = options.get("sliding_window", 0), options.get("logits_soft_cap", 0.0)

    def attend(begin: int, end: int) -> torch.Tensor:
        out = torch.empty_like(query[begin:end])
        torch.ops.pagedllm_cpu.paged_attention(query[begin:end].contiguous(), kv_cache, tables, torch.tensor([end]),
                                               torch.tensor([0, end - begin]), scale, out, scales, window, soft_cap)
        return out

    whole = attend(0, length)
    for chunk in (1, 7, 33):
        parts = torch.cat([attend(s, min(length, s + chunk)) for s in range(0, length, chunk)])
        assert torch.equal(parts, whole), (chunk, int((parts != whole).sum()))


# Long contexts for few sequences: fewer (sequence, KV head) pairs than threads would leave a thread idle,
# so each context is cut into 512-token partitions (flash-decoding) that the threads share and a
# log-sum-exp reduction merges. Shapes: the 386M Qwen2's heads (14/2, d 64: 7 query rows per KV head)
# and the demo model's (8/4, d 32); 4 query tokens as in speculative verification.
LONG_STEPS = [(1, 5000, 1, (14, 2, 64)), (2, 3001, 1, (8, 4, 32)), (1, 2100, 4, (8, 2, 64))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("sliding_window", [None, 700])
def test_partitioned_long_context_matches_the_reference_backend(dtype: torch.dtype, num_threads: int,
                                                                sliding_window: int | None) -> None:
    from pagedllm.attention.selector import get_attn_backend
    from pagedllm.benchmarks.attention import _step

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(num_threads)
        for seed, (batch, context, query_len, (heads, kv_heads, head_dim)) in enumerate(LONG_STEPS):
            query, new_kv, kv_cache, _, metadata = _step(context, batch, query_len, 16, heads, kv_heads, head_dim,
                                                         dtype, seed=seed)
            outputs = []
            for name in ("TORCH_SDPA", "CPU_FLASH"):
                backend = get_attn_backend(name, heads, kv_heads, head_dim, dtype, dtype, torch.device("cpu"),
                                           block_size=16)
                backend.prepare_metadata(metadata)
                outputs.append(backend.forward(query, new_kv, new_kv, kv_cache, metadata, head_dim ** -0.5,
                                               sliding_window=sliding_window).float())
            torch.testing.assert_close(outputs[1], outputs[0], **TOL[dtype])
    finally:
        torch.set_num_threads(threads)
