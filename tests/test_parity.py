"""Parity with Hugging Face transformers on the same random weights (issue 3, "Engine core").

For every supported architecture variant: a batch of token-id prompts of lengths 1..300, greedy 32 new
tokens with ignore_eos. The engine's tokens must equal transformers' `generate` run on each prompt alone,
and its first-token logprobs must agree with log_softmax of transformers' logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import build_model, hf_greedy, hf_logits, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.platform import cpu_has_native

MAX_NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 2, 15, 16, 17, 63, 130, 300]  # around block edges, and one long prompt
LOGPROB_ATOL = 1e-4  # fp32 on both sides; differences come only from summation order
NUM_LOGPROBS = 5
# Greedy decoding may legitimately differ where the two best logits are closer than fp32 noise.
TIE_GAP = 1e-4

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

ARCH_CASES: dict[str, dict[str, Any]] = {
    "llama_mha": dict(arch="llama", num_key_value_heads=4, seed=10),
    "llama_mqa": dict(arch="llama", num_key_value_heads=1, seed=11),
    "llama_gqa_head_dim": dict(arch="llama", num_key_value_heads=2, head_dim=32, seed=12),
    "llama_llama3_rope_legacy": dict(
        arch="llama", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0, rope_spelling="legacy", seed=13
    ),
    "llama_linear_rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}, seed=14),
    # transformers-4-era config.json: rope_scaling {"type": ...}, torch_dtype, no head_dim.
    "llama_linear_rope_legacy_type": dict(
        arch="llama", rope_scaling={"type": "linear", "factor": 2.0}, rope_spelling="legacy", seed=18
    ),
    # YaRN without DeepSeek's mscale pair: cos/sin scaled by 0.1 ln(factor) + 1.
    "llama_yarn_rope": dict(arch="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64}, seed=19),
    "mistral": dict(arch="mistral", seed=15),
    "qwen2_bias_tied": dict(arch="qwen2", tie_word_embeddings=True, seed=16),
    "qwen3_qk_norm": dict(arch="qwen3", head_dim=32, seed=17),
    # attention_bias puts a bias on o_proj too (not only q|k|v, as Qwen2's), mlp_bias on the MLP's three
    "llama_attention_and_mlp_bias": dict(arch="llama", attention_bias=True, extra_config={"mlp_bias": True}, seed=20),
    "qwen3_attention_bias": dict(arch="qwen3", head_dim=32, attention_bias=True, seed=21),
}


def assert_greedy_matches(model_dir: str, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Tokens must be equal; a divergence is accepted only at a near-tie of transformers' logits."""
    assert len(got) == len(want), f"engine gave {len(got)} tokens, transformers {len(want)}"
    if got == want:
        return
    step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = hf_logits(model_dir, prompt + want[:step])[-1]
    gap = (logits[want[step]] - logits[got[step]]).item()
    assert gap < TIE_GAP, (
        f"greedy tokens diverge at step {step} (prompt length {len(prompt)}): engine {got[step]}, "
        f"transformers {want[step]}, logit gap {gap:.3g} is not a tie\nengine: {got}\nhf:     {want}"
    )


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_greedy_parity_with_transformers(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = build_model(tmp_path_factory.mktemp(case), **ARCH_CASES[case])
    vocab_size = hf_logits(model_dir, [3]).shape[-1]
    prompts = random_prompts(len(PROMPT_LENGTHS), vocab_size, PROMPT_LENGTHS, seed=ARCH_CASES[case]["seed"])

    llm = LLM(model=model_dir, dtype="float32", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts)

    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        completion = out.outputs[0]
        want_ids, want_logits = hf_greedy(model_dir, prompt, MAX_NEW_TOKENS)
        assert completion.finish_reason == "length"
        assert_greedy_matches(model_dir, prompt, list(completion.token_ids), want_ids)

        # First generated position: the engine's top-N logprobs against transformers' log_softmax.
        want_logprobs = torch.log_softmax(want_logits, dim=-1)
        first = completion.logprobs[0]
        assert completion.token_ids[0] in first
        top_ids = torch.topk(want_logprobs, NUM_LOGPROBS).indices.tolist()
        for token_id, lp in first.items():
            assert lp.logprob == pytest.approx(want_logprobs[token_id].item(), abs=LOGPROB_ATOL), (
                f"{case}: prompt length {len(prompt)}, token {token_id}"
            )
        ranked = sorted((lp.rank, t) for t, lp in first.items() if lp.rank is not None)
        engine_top = [t for rank, t in ranked if rank <= NUM_LOGPROBS]
        # Same top-N set unless two of them are tied in fp32.
        sorted_lp = torch.sort(want_logprobs, descending=True).values
        if (sorted_lp[NUM_LOGPROBS - 1] - sorted_lp[NUM_LOGPROBS]).item() > TIE_GAP:
            assert set(engine_top) == set(top_ids), f"{case}: prompt length {len(prompt)}"


def test_prompt_logprobs_match_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """prompt_logprobs cover every prompt position (prefill over several chunks) and match transformers."""
    model_dir = build_model(tmp_path_factory.mktemp("plp"), "llama", seed=21)
    prompt = random_prompts(1, 512, [90], seed=21)[0]
    # A small token budget splits the prefill into chunks; logprobs must not depend on that.
    llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    want = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry, f"position {pos}: the prompt token must be included"
        for token_id, lp in entry.items():
            assert lp.logprob == pytest.approx(want[pos - 1, token_id].item(), abs=LOGPROB_ATOL), pos


def test_bfloat16_runs_close_to_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """dtype=bfloat16 loads fp32 weights, casts, and stays close to fp32 transformers (loose bound)."""
    model_dir = build_model(tmp_path_factory.mktemp("bf16"), "llama", seed=22)
    prompt = random_prompts(1, 512, [40], seed=22)[0]
    llm = LLM(model=model_dir, dtype="bfloat16")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1), use_tqdm=False)[0]
    want = torch.log_softmax(hf_logits(model_dir, prompt)[-1], dim=-1)
    token = out.outputs[0].token_ids[0]
    # bf16 has 8 mantissa bits; a two-layer toy keeps the error near 1e-2 in logprob.
    assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(want[token].item(), abs=0.15)


@pytest.mark.parametrize("legacy", [False, True], ids=["dtype_key", "torch_dtype_key"])
def test_dtype_auto_follows_the_checkpoint(tmp_path_factory: pytest.TempPathFactory, legacy: bool) -> None:
    """dtype="auto" runs in the checkpoint's dtype (config `dtype`, or `torch_dtype` in older files)."""
    model_dir = build_model(
        tmp_path_factory.mktemp("bf16ckpt"),
        "llama",
        dtype=torch.bfloat16,
        seed=23,
        rope_spelling="legacy" if legacy else "new",
    )
    prompt = random_prompts(1, 512, [30], seed=23)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)

    def first_logprobs(dtype: str) -> dict[int, float]:
        out = LLM(model=model_dir, dtype=dtype).generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        return {t: lp.logprob for t, lp in out.logprobs[0].items()}

    auto = first_logprobs("auto")
    if not cpu_has_native(torch.bfloat16):
        # On a CPU that would emulate bf16, auto runs the checkpoint in float32 instead.
        assert auto == first_logprobs("float32")
        return
    assert auto == first_logprobs("bfloat16")
    assert auto != first_logprobs("float32"), "fp32 and bf16 runs should not agree to the last bit"
