"""The engine on a CUDA device: skipped where there is none (CI), run where one is lent.

CPU is what CI runs; CUDA must work by design. These tests hold the CUDA path to the same oracles as the
CPU tests: the Triton kernels (which CPU tests only run under the Triton interpreter, where bf16 `tl.dot`
cannot be checked) against float64 attention at realistic head sizes and contexts; the engine's greedy
tokens and logprobs on the GPU against transformers on the CPU (fp32, so only summation order differs);
outputs that do not depend on chunking, prefix-cache hits, preemption or speculative decoding; one-byte
KV caches, weight quantization, MoE and MLA models running without leaking a block.

PAGEDLLM_TEST_DEVICE=cpu runs the engine tests here on the CPU (the Triton ones then need
TRITON_INTERPRET=1 and are slow): a dry run of the tests themselves on a machine without a GPU.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_attention_kernels import STEPS, TOL, naive_attention, random_step
from test_kv_cache_quant import assert_idle
from test_parity import assert_greedy_matches
from tiny_models import build_model, hf_greedy, hf_logits, random_prompts

from pagedllm import LLM, SamplingParams

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="no CUDA device")
TRITON_RUNS = DEVICE.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton needs a CUDA device or TRITON_INTERPRET=1")
BACKENDS = ["TORCH_SDPA", "TORCH_FLASH"] + (["TRITON"] if TRITON_RUNS else [])
PROMPT_LENGTHS = [1, 15, 16, 17, 63, 130, 300]
MAX_TOKENS = 24


def make_llm(model: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 30)  # not 90% of the device for each tiny engine
    return LLM(model=model, device=DEVICE, seed=0, max_model_len=512, **kwargs)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **params: Any
           ) -> list[tuple[list[int], list[float]]]:
    """(token ids, logprob of each) of every prompt's greedy completion."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, **params)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)])
            for o in outputs]


def assert_transformers_greedy(llm: LLM, model_dir: str, prompts: list[list[int]]) -> None:
    """Greedy tokens equal transformers' on the same weights, the first token's logprob within 1e-4 of
    its log-softmax, and the engine idle with every KV block free afterwards."""
    for prompt, (got, logprobs) in zip(prompts, greedy(llm, prompts)):
        want, logits = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert_greedy_matches(model_dir, prompt, got, want)
        if got[0] == want[0]:
            assert logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[want[0]].item(), abs=1e-4)
    assert_idle(llm)


@pytest.fixture(autouse=True)
def release_device_memory() -> Iterator[None]:
    """After each test, what its engines freed goes back to the device: torch's caching allocator would
    otherwise carve later, smaller allocations out of a dropped engine's KV segment, which then can never
    be returned, and a later engine sized from free memory would find none."""
    yield
    if DEVICE.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GQA 4/2 heads of 32 dims: head_dim 32 is the smallest tl.dot tile on GPUs."""
    return build_model(tmp_path_factory.mktemp("cuda_llama"), "llama", num_key_value_heads=2, head_dim=32,
                       seed=60)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(PROMPT_LENGTHS), 512, PROMPT_LENGTHS, seed=60)


# ---- the Triton kernels against float64 attention ----

@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size,group,head_dim", [(16, 4, 64), (32, 1, 128), (16, 8, 128), (64, 2, 96)])
def test_triton_kernels_match_float64_attention(dtype: torch.dtype, block_size: int, group: int,
                                                head_dim: int) -> None:
    from pagedllm.attention.triton_paged import paged_attention_decode, paged_attention_varlen

    tol = TOL.get(dtype, TOL[torch.bfloat16])
    for n, (seq_lens, query_lens) in enumerate(STEPS):
        query, cache, tables, lens, starts = random_step(seq_lens, query_lens, block_size, 2, group, head_dim,
                                                         dtype, seed=n)
        expected = naive_attention(query, cache, tables, lens, starts, head_dim ** -0.5)
        on = [t.to(DEVICE) for t in (query, cache, tables, lens, starts)]
        got = paged_attention_varlen(*on, head_dim ** -0.5)
        torch.testing.assert_close(got.cpu().double(), expected, **tol)
        if max(query_lens) == 1:
            got = paged_attention_decode(on[0], on[1], on[2], on[3], max(seq_lens), head_dim ** -0.5)
            torch.testing.assert_close(got.cpu().double(), expected, **tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernels_take_sliding_windows_and_soft_caps(dtype: torch.dtype) -> None:
    """Windows around a block and a split, soft-capping; blocks before each window are NaN: never read."""
    from test_attention_kernels import WINDOWS, poison_outside_window

    from pagedllm.attention.triton_paged import paged_attention_decode, paged_attention_varlen

    for n, (seq_lens, query_lens) in enumerate(STEPS):
        for window, cap in WINDOWS:
            step = random_step(seq_lens, query_lens, 16, 2, 4, 128, dtype, seed=n)
            if window is not None:
                step = poison_outside_window(step, window)
            expected = naive_attention(*step, 128 ** -0.5, sliding_window=window, logits_soft_cap=cap)
            on = [t.to(DEVICE) for t in step]
            got = paged_attention_varlen(*on, 128 ** -0.5, sliding_window=window, logits_soft_cap=cap)
            torch.testing.assert_close(got.cpu().double(), expected, **TOL[dtype])
            if max(query_lens) == 1:
                got = paged_attention_decode(on[0], on[1], on[2], on[3], max(seq_lens), 128 ** -0.5,
                                             sliding_window=window, logits_soft_cap=cap)
                torch.testing.assert_close(got.cpu().double(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_flash_recurrence_on_the_device(dtype: torch.dtype) -> None:
    from pagedllm.attention.torch_flash import paged_flash_attention

    for n, (seq_lens, query_lens) in enumerate(STEPS):
        step = random_step(seq_lens, query_lens, 16, 2, 4, 64, dtype, seed=n)
        expected = naive_attention(*step, 0.125)
        got = paged_flash_attention(*[t.to(DEVICE) for t in step], 0.125)
        torch.testing.assert_close(got.cpu().double(), expected, **TOL[dtype])


# ---- the engine against transformers ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_parity_with_transformers(llama_dir: str, prompts: list[list[int]],
                                        backend: str) -> None:
    llm = make_llm(llama_dir, attention_backend=backend)
    assert llm.llm_engine.model_runner.device.type == torch.device(DEVICE).type
    assert llm.llm_engine.model_runner.backend.name == backend
    assert_transformers_greedy(llm, llama_dir, prompts)


def test_default_engine_takes_the_device_memory_and_a_later_one_gets_it_back(llama_dir: str) -> None:
    """What a user gets naming nothing: TRITON on CUDA, the KV cache sized from gpu_memory_utilization. An
    engine built after another was dropped gets the same pool: what the first freed is still reserved by
    torch's caching allocator and must not count as used."""
    blocks = []
    for _ in range(2):
        llm = LLM(model=llama_dir, device=DEVICE, max_model_len=512)
        if DEVICE.startswith("cuda"):
            assert llm.llm_engine.model_runner.backend.name == "TRITON"
        out = llm.generate(["def fibonacci(n"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        blocks.append(llm.llm_engine.kv_cache_manager.pool.num_blocks)
        del llm, out
    assert blocks[1] >= 0.99 * blocks[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_tokens_are_transformers_argmax_within_bf16_noise(llama_dir: str, prompts: list[list[int]],
                                                               backend: str) -> None:
    """bf16 on the device: every greedy token is, teacher-forced, within bf16 rounding of transformers'
    (fp32) best logit; tensor-core kernels round differently from the CPU, so exact equality is not owed."""
    llm = make_llm(llama_dir, dtype="bfloat16", attention_backend=backend)
    for prompt, (got, _) in zip(prompts, greedy(llm, prompts, max_tokens=12)):
        logits = hf_logits(llama_dir, prompt + got)[len(prompt) - 1:-1]
        best = logits.max(-1).values
        chosen = logits.gather(-1, torch.tensor(got)[:, None])[:, 0]
        gap = (best - chosen).max().item()
        assert gap < 0.05 * best.abs().max().item() + 0.05, f"bf16 greedy token {gap:.3g} below the best logit"
    assert_idle(llm)


# ---- invariance: chunking, prefix caching, preemption, speculative decoding ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_do_not_depend_on_scheduling(llama_dir: str, prompts: list[list[int]], backend: str) -> None:
    reference = greedy(make_llm(llama_dir, attention_backend=backend), prompts)
    shared = prompts[-1][:200]
    extra = [shared + [5, 6, 7], shared + [9] * 40]
    want_extra = greedy(make_llm(llama_dir, attention_backend=backend), extra)
    # A 48-token budget chunks every long prompt; prefix caching serves the shared prefix; 40 blocks of 16
    # tokens cannot hold the batch, so requests are preempted and recomputed.
    llm = make_llm(llama_dir, attention_backend=backend, max_num_batched_tokens=48, enable_prefix_caching=True,
                   num_gpu_blocks_override=40)
    got = greedy(llm, prompts + extra)
    for (want_ids, want_lps), (got_ids, got_lps) in zip(reference + want_extra, got):
        assert got_ids == want_ids
        assert got_lps == pytest.approx(want_lps, abs=1e-4)
    assert_idle(llm)


def test_ngram_speculative_decoding_is_lossless(llama_dir: str) -> None:
    # Repetitive prompts so the n-gram proposer finds matches and some proposals are accepted.
    prompts = [[7, 8, 9, 10] * 20, [100, 101, 102] * 30 + [5]]
    want = greedy(make_llm(llama_dir), prompts, max_tokens=32)
    llm = make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_max": 3})
    got = greedy(llm, prompts, max_tokens=32)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert_idle(llm)


def test_seeded_sampling_does_not_depend_on_the_batch(llama_dir: str, prompts: list[list[int]]) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    llm = make_llm(llama_dir)
    together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [list(llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids)
             for p, sp in zip(prompts, params)]
    assert together == alone
    n = llm.generate([prompts[3]], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1), use_tqdm=False)
    assert len(n[0].outputs) == 4
    assert_idle(llm)


# ---- one-byte KV caches, quantized weights, MoE and MLA ----

@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_byte_kv_cache(llama_dir: str, prompts: list[list[int]], kv_cache_dtype: str, backend: str) -> None:
    llm = make_llm(llama_dir, kv_cache_dtype=kv_cache_dtype, attention_backend=backend,
                   enable_prefix_caching=True)
    cold = greedy(llm, prompts[-2:], max_tokens=8)
    warm = greedy(llm, prompts[-2:], max_tokens=8)  # the prompts now come from the prefix cache
    for (cold_ids, cold_lps), (warm_ids, warm_lps) in zip(cold, warm):
        assert cold_ids == warm_ids
        assert cold_lps == pytest.approx(warm_lps, abs=1e-4)
    # The CPU's reference backend on the same one-byte codes (up to a code rounded the other way).
    cpu = LLM(model=llama_dir, device="cpu", dtype="float32", max_model_len=512, kv_cache_dtype=kv_cache_dtype,
              attention_backend="TORCH_SDPA")
    for (_, lps), (_, want_lps) in zip(cold, greedy(cpu, prompts[-2:], max_tokens=1)):
        assert lps[0] == pytest.approx(want_lps[0], abs=0.02)
    assert_idle(llm)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_weight_quantization(llama_dir: str, prompts: list[list[int]], quantization: str) -> None:
    llm = make_llm(llama_dir, dtype="bfloat16", quantization=quantization)
    got = greedy(llm, prompts[:3], max_tokens=8)
    assert all(len(ids) == 8 for ids, _ in got)
    assert_idle(llm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral"])
def test_sliding_window_models_parity(tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]],
                                      arch: str, backend: str) -> None:
    """Windows of 40 tokens (Gemma: on local layers; Mistral: on every layer, whose blocks behind the window
    go back to the pool), Gemma 2's soft caps, Gemma 3's local RoPE; chunked prefill across the window."""
    extra: dict[str, Any] = dict(sliding_window=40)
    if arch == "gemma2":
        extra.update(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    model = build_model(tmp_path_factory.mktemp(arch), arch, num_hidden_layers=3, head_dim=32, seed=62,
                        extra_config=extra)
    llm = make_llm(model, attention_backend=backend, max_num_batched_tokens=64)
    assert_transformers_greedy(llm, model, prompts)


def test_moe_parity(tmp_path_factory: pytest.TempPathFactory) -> None:
    from test_moe import MOE_CASES

    spec = MOE_CASES["qwen3_moe_norm_topk"]
    model_dir = build_model(tmp_path_factory.mktemp("cuda_moe"), **spec)
    prompts = random_prompts(4, 512, [3, 20, 70, 130], seed=spec["seed"])
    for prompt, (got, _) in zip(prompts, greedy(make_llm(model_dir, max_num_batched_tokens=64), prompts)):
        assert_greedy_matches(model_dir, prompt, got, hf_greedy(model_dir, prompt, MAX_TOKENS)[0])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mla_parity(tmp_path_factory: pytest.TempPathFactory, kv_cache_dtype: str) -> None:
    from test_deepseek import DEEPSEEK_CASES

    spec = DEEPSEEK_CASES["v3_q_lora_yarn"]
    model_dir = build_model(tmp_path_factory.mktemp("cuda_mla"), **spec)
    prompts = random_prompts(4, 512, [3, 20, 70, 130], seed=spec["seed"])
    llm = make_llm(model_dir, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    got = greedy(llm, prompts)
    if kv_cache_dtype == "auto":
        for prompt, (ids, _) in zip(prompts, got):
            assert_greedy_matches(model_dir, prompt, ids, hf_greedy(model_dir, prompt, MAX_TOKENS)[0])
    assert_idle(llm)


def test_demo_model_fp32_matches_the_cpu() -> None:
    """The bundled demo model (the quick start's) in fp32: the device's greedy text is the CPU's."""
    from pagedllm.assets import demo_model_path

    model = demo_model_path()
    prompts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "class Counter:"]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    cpu = LLM(model=model, device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    dev = LLM(model=model, device=DEVICE, dtype="float32").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in dev] == [o.outputs[0].text for o in cpu]
