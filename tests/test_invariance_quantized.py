"""Scheduling must not change results with weight-only quantized linears either (int4, int8 per channel
and per group, bf16 activations): a request's greedy output is the same alone, batched with 31 others
(so its rows meet the kernels at other row counts and in other 4-row blocks), with prefill split into
small chunks, and under preemption. With pagedllm's VNNI kernel each activation row is quantized alone
and summed in one order; torch's int8 path (where the CPU lacks AVX512-VNNI) switches kernels at 16 rows
and is not held to this.
"""

from __future__ import annotations

import pytest
import torch
from test_invariance import MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, assert_no_leaks, token_ids

from pagedllm import LLM
from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled

pytestmark = pytest.mark.skipif(not kernel_enabled(torch.bfloat16), reason="no AVX512-VNNI (or kernels not built)")

METHODS = [pytest.param(dict(quantization="int4", quantization_group_size=32), "2", id="int4_g32"),
           pytest.param(dict(quantization="int8"), "2", id="int8_per_channel"),
           pytest.param(dict(quantization="int8", quantization_group_size=32), "2", id="int8_g32"),
           pytest.param(dict(quantization="int4", quantization_group_size=32), "1", id="int4_g32_one_term")]


def _llm(model: str, quantization: dict, **engine_args) -> LLM:
    llm = LLM(model=model, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, **quantization, **engine_args)
    layer = llm.llm_engine.model_runner.model.layers[0]
    assert isinstance(layer.mlp.down_proj.weight, VnniWeight)
    return llm


@pytest.mark.parametrize("quantization,activation_terms", METHODS)
def test_quantized_outputs_do_not_depend_on_the_batch(tiny_llama_dir: str, quantization: dict, activation_terms: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_QUANT_ACTIVATION_TERMS", activation_terms)
    alone = _llm(tiny_llama_dir, quantization, enable_prefix_caching=False)
    want = [token_ids(alone, [p])[0] for p in PROMPTS]
    del alone
    assert token_ids(_llm(tiny_llama_dir, quantization), PROMPTS) == want
    chunked = _llm(tiny_llama_dir, quantization, max_num_batched_tokens=7, max_num_seqs=3)
    assert token_ids(chunked, PROMPTS) == want
    assert_no_leaks(chunked)
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    preempted = _llm(tiny_llama_dir, quantization, block_size=16, num_gpu_blocks_override=-(-longest // 16) + 3)
    assert token_ids(preempted, PROMPTS) == want
