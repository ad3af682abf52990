"""Linear weights prepacked on CPU (pagedllm.layers.linear.prepack_linear_weights), in pagedllm's blocked
layout where this CPU's C++ ops support the dtype and in oneDNN's otherwise: the same outputs as F.linear
on the plain weights (oneDNN: bit-identical in bf16; otherwise to rounding), every row computed the same
way whatever else is in the batch, quantized projections left to their own kernels, and
PAGEDLLM_CPU_PREPACK_WEIGHTS=0 (plain) / =onednn as the ways back."""

from __future__ import annotations

import mmap
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import (
    PREPACK_ENV,
    BlockedLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    blocked_layout_available,
    is_prepacked,
    packed_linear,
    prepack_enabled,
    prepack_linear_weights,
)

pytestmark = pytest.mark.skipif(not prepack_enabled(torch.device("cpu"), torch.float32),
                                reason="torch built without oneDNN")


def _layers(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.up = MergedColumnParallelLinear(48, [40, 40], True, dtype)
    model.down = RowParallelLinear(40, 48, False, dtype)
    model.head = ParallelLMHead(100, 48, dtype)
    for param in model.parameters():
        param.data.normal_(0, 0.1)
    return model


def _onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN reorders bf16 weights only on CPUs with AVX-512 (or AVX-NE-CONVERT); elsewhere
    prepack_linear_weights refuses and keeps F.linear, which test_refused_prepack_keeps_plain_weights checks."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def _use_layout(layout: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Select a layout through PAGEDLLM_CPU_PREPACK_WEIGHTS, or skip where this CPU cannot run it."""
    monkeypatch.setenv(PREPACK_ENV, layout)
    if layout == "onednn" and not _onednn_packs(dtype):
        pytest.skip(f"oneDNN does not prepack {dtype} weights on this CPU")
    if layout == "blocked" and not blocked_layout_available(dtype):
        pytest.skip(f"the blocked kernel does not run {dtype} on this CPU (AVX-512 / AVX512-BF16)")
    if layout == "amx" and not _amx_runs(dtype):
        pytest.skip(f"no AMX tiles for {dtype} on this CPU")


def _amx_runs(dtype: torch.dtype) -> bool:
    """The blocked kernel runs on AMX tiles here (bf16 on a CPU with amx_bf16)."""
    return blocked_layout_available(dtype) and bool(torch.ops.pagedllm_cpu_linear.blocked_linear_supports(dtype, True))


@pytest.mark.parametrize("layout", ["blocked", "amx", "onednn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_layers_match_f_linear(dtype: torch.dtype, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_layout(layout, dtype, monkeypatch)
    model = _layers(dtype)
    model.embed = VocabParallelEmbedding(100, 48, dtype)
    model.embed.weight = model.head.weight  # tied: the embedding reads the head's weight by rows
    x = torch.randn(5, 48, dtype=dtype)
    plain = {"up": F.linear(x, model.up.weight, model.up.bias), "head": F.linear(x, model.head.weight).float()}
    plain["down"] = F.linear(plain["up"][:, :40], model.down.weight)
    assert prepack_linear_weights(model, torch.device("cpu"), dtype) == 3
    assert is_prepacked(model.up.matmul)
    assert isinstance(model.up.matmul, BlockedLinear) == (layout != "onednn")
    assert getattr(model.up.matmul, "amx", False) == (layout == "amx")
    assert not model.head.weight.is_mkldnn  # the embedding's rows stay readable; the head has a copy
    packed = {"up": model.up(x), "head": model.head.compute_logits(x)}
    packed["down"] = model.down(plain["up"][:, :40])
    for name in plain:
        assert packed[name].shape == plain[name].shape and packed[name].dtype == plain[name].dtype, name
        if dtype == torch.bfloat16 and layout == "onednn":
            assert torch.equal(packed[name], plain[name]), name
        elif dtype == torch.bfloat16:  # another summation order: at most a rounding step of bf16 apart
            torch.testing.assert_close(packed[name], plain[name], rtol=1.6e-2, atol=1e-3)
        else:
            torch.testing.assert_close(packed[name], plain[name], rtol=1e-5, atol=1e-5)
    assert prepack_linear_weights(model, torch.device("cpu"), dtype) == 0  # already packed: nothing to do


def test_an_lm_head_no_embedding_reads_keeps_only_its_packed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_layout("blocked", torch.bfloat16, monkeypatch)
    model = _layers(torch.bfloat16)
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    want = model.head.compute_logits(x)
    assert prepack_linear_weights(model, torch.device("cpu"), torch.bfloat16) == 3
    assert model.head.weight is None and model.head.packed_weight is not None
    torch.testing.assert_close(model.head.compute_logits(x), want, rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(1, 1), (63, 33), (64, 64), (130, 97), (700, 300), (192, 96), (128, 4864)])
def test_blocked_kernel_against_float64(dtype: torch.dtype, out_features: int, in_features: int, amx: bool) -> None:
    """Odd sizes (padded to the 64-wide blocks and, in bf16, to pairs of k; on AMX tiles, k past the last
    step of 32 and a block narrower than 64), a bias, and 3-D input: the kernel stays within the dtype's
    rounding of a float64 product, as F.linear does."""
    if not blocked_layout_available(dtype):
        pytest.skip(f"the blocked kernel does not run {dtype} on this CPU")
    if amx and not _amx_runs(dtype):
        pytest.skip(f"no AMX tiles for {dtype} on this CPU")
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, in_features, dtype=dtype), torch.randn(out_features, dtype=dtype)
    x = torch.randn(2, 7, in_features, dtype=dtype)
    packed = torch.ops.pagedllm_cpu_linear.blocked_linear_pack(weight)
    out = BlockedLinear(out_features, amx)(x, packed, bias)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert out.shape == exact.shape and out.dtype == dtype
    ours = (out.double() - exact).abs().max()
    theirs = (F.linear(x, weight, bias).double() - exact).abs().max()
    scale = exact.abs().max()
    assert ours <= max(2 * theirs, (1e-2 if dtype == torch.bfloat16 else 1e-5) * scale), (ours, theirs)
    # each row alone is the batch's row (on AMX tiles: exact row tiles, padded ones, and k in chunks)
    rows = torch.randn(37, in_features, dtype=dtype)
    batch = BlockedLinear(out_features, amx)(rows, packed, bias)
    for r in (0, 15, 16, 36):
        assert torch.equal(BlockedLinear(out_features, amx)(rows[r:r + 1], packed, bias), batch[r:r + 1]), r


def test_prepack_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREPACK_ENV, "0")
    model = _layers(torch.float32)
    assert prepack_linear_weights(model, torch.device("cpu"), torch.float32) == 0
    assert not model.up.weight.is_mkldnn and model.head.packed_weight is None
    assert prepack_linear_weights(_layers(torch.float16), torch.device("cpu"), torch.float16) == 0


def _generate(model_dir: str, dtype: str, **kwargs) -> list:
    llm = LLM(model=model_dir, dtype=dtype, seed=0, max_model_len=128, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(["def fibonacci(n):", "The quick brown fox"], params,
                                               use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_outputs_unchanged(tiny_qwen2_dir: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = _generate(tiny_qwen2_dir, dtype)
    monkeypatch.setenv(PREPACK_ENV, "0")
    plain = _generate(tiny_qwen2_dir, dtype)
    bit_identical = dtype == "bfloat16" and not blocked_layout_available(torch.bfloat16)  # oneDNN's bf16
    for a, b in zip(packed, plain):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                if bit_identical:
                    assert lp_a[token].logprob == lp_b[token].logprob
                else:
                    tolerance = 5e-2 if dtype == "bfloat16" else 1e-4
                    assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=tolerance)


def test_quantized_projections_keep_their_kernel(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", quantization="int8", seed=0, max_model_len=128)
    model = llm.llm_engine.model_runner.model
    assert not any(is_prepacked(layer.mlp.gate_up_proj.matmul) for layer in model.layers)
    assert model.lm_head.packed_weight is not None  # the LM head stays full precision, so it is packed
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_refused_prepack_keeps_plain_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN cannot reorder a dtype's weights, every layer keeps its plain weight and F.linear."""
    monkeypatch.setenv(PREPACK_ENV, "onednn")
    dtype = next((d for d in (torch.bfloat16, torch.float32) if not _onednn_packs(d)), None)
    if dtype is None:
        pytest.skip("oneDNN prepacks every dtype on this CPU")
    model = _layers(dtype)
    x = torch.randn(5, 48, dtype=dtype)
    plain = F.linear(x, model.up.weight, model.up.bias)
    assert prepack_linear_weights(model, torch.device("cpu"), dtype) == 0
    assert not model.up.weight.is_mkldnn and model.head.packed_weight is None
    assert torch.equal(model.up(x), plain)


@pytest.mark.parametrize("layout", ["blocked", "amx", "onednn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_rows_do_not_depend_on_the_batch(dtype: torch.dtype, layout: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Why a target model stays packed: either layout computes a row the same way in any batch (the
    blocked kernel's register tiles of 6 rows, its AMX tiles of 16 and its 256-row passes included), on
    any number of threads."""
    _use_layout(layout, dtype, monkeypatch)
    model = _layers(dtype)
    prepack_linear_weights(model, torch.device("cpu"), dtype)
    x = torch.randn(300, 48, dtype=dtype)
    full = model.up(x)
    for rows in (1, 2, 3, 5, 6, 7, 16, 257):
        assert torch.equal(model.up(x[:rows]), full[:rows]), rows
        assert torch.equal(model.up(x[rows:rows + 1]), full[rows:rows + 1]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(model.up(x), full)
        assert torch.equal(model.head.compute_logits(x[:3]), model.head.compute_logits(x)[:3])
    finally:
        torch.set_num_threads(threads)


def test_not_batch_invariant_keeps_small_fp32_weights_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """With oneDNN's layout, a draft (batch_invariant=False) keeps fp32 weights up to PLAIN_FP32_MAX_NUMEL
    for F.linear; larger ones, and 16-bit ones, are packed as for a target."""
    import pagedllm.layers.linear as linear_module

    monkeypatch.setenv(PREPACK_ENV, "onednn")
    model = _layers(torch.float32)
    x = torch.randn(5, 48)
    plain = model.up(x)
    assert prepack_linear_weights(model, torch.device("cpu"), torch.float32, batch_invariant=False) == 0
    assert model.up.matmul is not packed_linear and not model.up.weight.is_mkldnn
    assert model.head.packed_weight is None
    assert torch.equal(model.up(x), plain)
    # up (80 x 48) and head (100 x 48) above the limit, down (48 x 40) below it
    monkeypatch.setattr(linear_module, "PLAIN_FP32_MAX_NUMEL", 48 * 40)
    assert prepack_linear_weights(model, torch.device("cpu"), torch.float32, batch_invariant=False) == 2
    assert model.up.weight.is_mkldnn and model.head.packed_weight is not None
    assert not model.down.weight.is_mkldnn
    if _onednn_packs(torch.bfloat16):
        assert prepack_linear_weights(_layers(torch.bfloat16), torch.device("cpu"), torch.bfloat16,
                                      batch_invariant=False) == 3


def test_blocked_layout_packs_a_draft_whole() -> None:
    """The blocked kernel is batch-invariant and, on small weights, as fast as F.linear: a draft
    (batch_invariant=False) gets every weight packed too."""
    if not blocked_layout_available(torch.float32):
        pytest.skip("the blocked kernel does not run float32 on this CPU")
    model = _layers(torch.float32)
    assert prepack_linear_weights(model, torch.device("cpu"), torch.float32, batch_invariant=False) == 3
    assert isinstance(model.down.matmul, BlockedLinear) and isinstance(model.head.packed_matmul, BlockedLinear)


@pytest.mark.slow
def test_blocked_kernel_avx2_build(tmp_path: Path) -> None:
    """The AVX2 + FMA variant of the blocked kernel (16-wide blocks, fp32 only), built for x86-64-v3 in its
    own process, so that an AVX-512 machine tests the path AVX2-only CPUs run: float64 parity, odd sizes,
    batch and thread invariance."""
    from pagedllm.platform import _cpu_flags

    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2 and FMA")
    package = Path(__file__).resolve().parent.parent / "pagedllm"
    source, headers = package / "layers" / "csrc" / "cpu_linear.cpp", package / "csrc"
    code = textwrap.dedent(f"""
        import torch, torch.nn.functional as F
        from torch.utils.cpp_extension import load
        load(name="blocked_linear_avx2", sources=[{str(source)!r}], build_directory={str(tmp_path)!r},
             extra_include_paths=[{str(headers)!r}],
             extra_cflags=["-O3", "-fopenmp", "-std=c++17", "-march=x86-64-v3"], extra_ldflags=["-fopenmp"],
             is_python_module=False)
        ops = torch.ops.pagedllm_cpu_linear
        assert ops.blocked_linear_supports(torch.float32) and not ops.blocked_linear_supports(torch.bfloat16)
        torch.manual_seed(0)
        for n, k in ((1, 1), (17, 5), (130, 33), (700, 300)):
            w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(300, k)
            packed = ops.blocked_linear_pack(w)
            assert packed.numel() == n * k
            y = ops.blocked_linear(x, packed, n, b)
            exact = F.linear(x.double(), w.double(), b.double())
            assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), (n, k)
            for rows in (1, 5, 6, 7, 257):
                assert torch.equal(ops.blocked_linear(x[:rows], packed, n, b), y[:rows]), (n, k, rows)
                assert torch.equal(ops.blocked_linear(x[rows:rows + 1], packed, n, b), y[rows:rows + 1])
            torch.set_num_threads(2)
            assert torch.equal(ops.blocked_linear(x, packed, n, b), y)
            torch.set_num_threads(1)
        print("avx2 ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "avx2 ok" in result.stdout, result.stderr[-3000:]


def test_blocked_weights_live_in_one_buffer_in_reading_order() -> None:
    """A decode step streams the model's packed weights front to back through one buffer."""
    if not blocked_layout_available(torch.float32):
        pytest.skip("the blocked kernel does not run float32 on this CPU")
    model = _layers(torch.float32)
    prepack_linear_weights(model, torch.device("cpu"), torch.float32)
    weights = [model.up.weight, model.down.weight, model.head.packed_weight]
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    starts = [w.data_ptr() for w in weights]
    assert starts == sorted(starts) and all(start % 64 == 0 for start in starts)


def test_huge_page_buffer() -> None:
    from pagedllm.platform import HUGE_PAGE_BYTES, huge_page_buffer

    buffer = huge_page_buffer(3 * HUGE_PAGE_BYTES + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE_BYTES + 5
    buffer.fill_(7)
    assert int(buffer[-1]) == 7
    if platform.system() == "Linux" and hasattr(mmap, "MADV_HUGEPAGE") \
            and os.environ.get("PAGEDLLM_CPU_HUGE_PAGES", "1") != "0":
        assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0  # so that the kernel can map it with huge pages
    assert huge_page_buffer(100).numel() == 100


def test_zero_page_buffer_reads_zeros_and_holds_no_memory_until_written() -> None:
    """The KV cache's memory: 256 MiB of zeros that the process holds only where written, whatever state
    loading left the heap in (calloc cleared a freed-and-trimmed heap's 1.5 GiB cache at start-up)."""
    from pagedllm.platform import zero_page_buffer

    if platform.system() != "Linux":
        pytest.skip("reads /proc/self/statm")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    buffer = zero_page_buffer(256 << 20)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 256 << 20
    assert resident() - before < 16 << 20
    buffer[: 1 << 20].fill_(3)
    assert int(buffer[(1 << 20) - 1]) == 3 and int(buffer[-1]) == 0 and int(buffer[1 << 20]) == 0
    assert resident() - before < 24 << 20
    assert zero_page_buffer(0).numel() == 0


def test_blocked_pack_into_a_given_buffer() -> None:
    """The model's buffer is packed in place; a buffer of the wrong size is refused, not overrun."""
    if not blocked_layout_available(torch.bfloat16):
        pytest.skip("the blocked kernel does not run bfloat16 on this CPU")
    ops = torch.ops.pagedllm_cpu_linear
    weight = torch.randn(70, 33, dtype=torch.bfloat16)  # an odd in_features: padded to pairs
    assert ops.blocked_linear_packed_numel(weight) == 70 * 34
    out = torch.empty(70 * 34, dtype=torch.bfloat16)
    assert ops.blocked_linear_pack(weight, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, ops.blocked_linear_pack(weight))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.blocked_linear_pack(weight, torch.empty(70 * 33, dtype=torch.bfloat16))


@pytest.mark.skipif(not blocked_layout_available(torch.bfloat16), reason="no blocked bf16 kernel on this CPU")
def test_lm_head_argmax_in_one_pass(tiny_qwen2_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain-greedy step's LM head and argmax in one pass over the blocked bf16 weight (the logits never
    stored): the index argmax_rows gives on the logits blocked_linear stores, ties to the first column,
    +0 and -0 equal, the first NaN winning, at any width, batch and thread count; and an engine's greedy
    tokens are those of the stored logits."""
    from pagedllm.layers.sampler import argmax_rows

    ops = torch.ops.pagedllm_cpu_linear
    torch.manual_seed(0)
    for rows, k, n, case in [(1, 256, 8192, "random"), (7, 256, 1000, "ties"), (64, 256, 8192, "ties"),
                             (300, 64, 65, "ties"), (6, 33, 63, "random"), (5, 64, 17, "zeros"),
                             (9, 64, 700, "nan"), (4, 64, 129, "inf"), (2, 32, 1, "random")]:
        weight = (torch.randn(n, k) * 0.5).bfloat16()
        x = torch.randn(rows, k).bfloat16()
        if case == "ties":  # rounded inputs and repeated weight rows: many equal logits
            weight[n // 2] = weight[n - 1] = weight[min(3, n - 1)]
            weight[:n // 4] = weight[:n // 4].round()
            x = x.round()
        elif case == "zeros":  # rows of -0.0 and +0.0 logits, one negative
            weight[:] = 0.0
            weight[5::7] = -0.0
            weight[n // 3, 0] = -1.0
            x = x.abs() + 0.5
        elif case == "nan":
            weight[n // 5, 1] = float("nan")
            weight[n // 2, 2] = float("inf")
        elif case == "inf":
            weight[:, 0] = float("-inf")
            x[:, 0] = 1.0
        packed = ops.blocked_linear_pack(weight)
        for amx in (False, True) if _amx_runs(torch.bfloat16) else (False,):
            logits = ops.blocked_linear(x, packed, n, None, amx)
            want = argmax_rows(logits)
            assert torch.equal(want, logits.float().argmax(dim=-1))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(ops.blocked_linear_argmax(x, packed, n, amx), want), (rows, k, n, case, amx)
            torch.set_num_threads(1)

    llm = LLM(model=tiny_qwen2_dir, dtype="bfloat16", seed=0, max_model_len=256)
    model = llm.llm_engine.model_runner.model
    assert isinstance(model.lm_head.packed_matmul, BlockedLinear)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 400 + 5 for j in range(4 + 3 * i)]} for i in range(6)]
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    lm_head = model.lm_head
    monkeypatch.setattr(lm_head, "argmax", lambda hidden: argmax_rows(lm_head.compute_logits(hidden, upcast=False)))
    stored = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == stored
