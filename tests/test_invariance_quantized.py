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


def _dense_ops() -> bool:
    return kernel_enabled(torch.bfloat16) and bool(torch.ops.pagedllm_cpu_qlinear.qlinear_dense_supports(False))


@pytest.mark.skipif(not _dense_ops(), reason="no AVX512-BF16 for the dense prompt rows")
@pytest.mark.parametrize("prompt_rows", ["dense", "integer"])
def test_a_prompt_row_takes_its_path_in_whatever_step_computes_it(tiny_llama_dir: str, prompt_rows: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt rows may take another arithmetic than generated rows (PAGEDLLM_QUANT_PROMPT_ROWS=dense): a
    prompt's last token left alone by a prefix-cache hit (a one-token step, which the runner builds as a
    decode step) and a request's generated tokens recomputed after preemption must each be computed as
    they are when the prompt is prefilled whole and its tokens are generated."""
    monkeypatch.setenv("PAGEDLLM_QUANT_PROMPT_ROWS", prompt_rows)
    quantization = dict(quantization="int4", quantization_group_size=32)
    shared = PROMPTS[-8]  # 40 tokens: two full blocks and 8 more
    first, second = shared[:32], shared[:33]  # `second` after `first`: all but its last token cached
    alone = _llm(tiny_llama_dir, quantization, enable_prefix_caching=False)
    assert alone.llm_engine.model_runner.routes_prompt_rows == (prompt_rows == "dense")
    want = [token_ids(alone, [p])[0] for p in (first, second)]
    del alone
    cached = _llm(tiny_llama_dir, quantization)
    assert [token_ids(cached, [first])[0], token_ids(cached, [second])[0]] == want
    assert_no_leaks(cached)
    del cached
    longest = len(second) + MAX_TOKENS
    preempted = _llm(tiny_llama_dir, quantization, block_size=16, num_gpu_blocks_override=-(-longest // 16) + 1,
                     enable_prefix_caching=False)
    assert token_ids(preempted, [first, second]) == want
    assert_no_leaks(preempted)
    del preempted
    # A chat's next turn: the last answer's tokens, generated rows then, are prompt rows now. Its blocks
    # are no hit for the longer prompt (their hash says where the prompt ended), so they are recomputed.
    turn = first + want[0] + shared[32:40]
    alone = _llm(tiny_llama_dir, quantization, enable_prefix_caching=False)
    want_turn = token_ids(alone, [turn])
    del alone
    cached = _llm(tiny_llama_dir, quantization, block_size=8)
    token_ids(cached, [first])
    assert token_ids(cached, [turn]) == want_turn
    assert_no_leaks(cached)


def test_prompt_rows_split_a_batch_into_runs() -> None:
    from pagedllm.forward_context import RowSplit

    assert RowSplit.from_runs(5, [(0, 0), (3, 3)]) is None
    whole = RowSplit.from_runs(5, [(0, 2), (2, 5)])
    assert whole.prompt == slice(0, 5) and whole.other is None
    tail = RowSplit.from_runs(6, [(4, 6)])
    assert tail.prompt == slice(4, 6) and tail.other == slice(0, 4)
    head = RowSplit.from_runs(6, [(0, 2)])
    assert head.prompt == slice(0, 2) and head.other == slice(2, 6)
    scattered = RowSplit.from_runs(7, [(1, 2), (4, 6)])
    assert scattered.prompt.tolist() == [1, 4, 5] and scattered.other.tolist() == [0, 2, 3, 6]
