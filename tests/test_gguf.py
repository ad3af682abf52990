"""GGUF files: pagedllm against transformers loading the same file (dequantized, fp32), token for token.

The files are written by tests/gguf_models.py from random tiny models, in llama.cpp's layout (its
tensor names, the llama q/k row permutation, the tokenizer and chat template in the metadata).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from gguf_models import write_gguf
from tiny_models import build_model, training_text

from pagedllm import LLM, SamplingParams
from pagedllm.models.gguf import load_gguf_tokenizer, resolve_gguf_file

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Hello, world! How", "class Counter:\n    def"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf_src")
    return {
        "llama": build_model(root / "llama", "llama", seed=0),
        "qwen2": build_model(root / "qwen2", "qwen2", tie_word_embeddings=True, seed=1),
        "qwen3": build_model(root / "qwen3", "qwen3", seed=2),
        # K-quants pack 256 weights a block: every input dimension a multiple of 256
        "llama256": build_model(root / "llama256", "llama", hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, seed=3),
        # Windows shorter than the prompts; transformers reads neither Gemma 3's pattern nor Gemma 2's
        # soft caps from a GGUF file, so these keep its defaults (every 6th layer global; caps 50 and 30).
        # The file has no query_pre_attn_scalar: below 27B it is the head size, as in published Gemmas.
        "gemma2": build_model(root / "gemma2", "gemma2", head_dim=16, tie_word_embeddings=True, seed=4,
                              extra_config=dict(sliding_window=3, query_pre_attn_scalar=16)),
        "gemma3": build_model(root / "gemma3", "gemma3", num_hidden_layers=6, head_dim=16, tie_word_embeddings=True,
                              seed=5, extra_config=dict(sliding_window=3, query_pre_attn_scalar=16)),
        # Phi-4-mini's partial rotary and the 128k models' LongRoPE, which llama.cpp's converter writes
        # (the factors as tensors) and transformers' GGUF map drops: its reference takes this config (the
        # short factors serve: max_model_len is the original length)
        "phi3": build_model(root / "phi3", "phi3", seed=6, extra_config=dict(
            sliding_window=3, partial_rotary_factor=0.5, original_max_position_embeddings=1024,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0 + 0.1 * i for i in range(4)],
                             "long_factor": [2.0 + 0.5 * i for i in range(4)]})),
        # Experts stacked per layer (blk.N.ffn_*_exps), their width from expert_feed_forward_length, which
        # transformers' metadata map drops (its reference takes this config). The file has no flag for
        # norm_topk_prob: llama.cpp's Qwen3-MoE graph always renormalizes the top-k weights, as published
        # Qwen3-MoE models do, and transformers' GGUF config sets it so.
        "qwen3_moe": build_model(root / "qwen3_moe", "qwen3_moe", seed=7, extra_config=dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    }


def _hf_reference(path: str, original: str | None = None) -> tuple[torch.nn.Module, object]:
    """transformers on the file's (dequantized) weights; with the config of `original`, the model the file
    was written from, where transformers' metadata map drops settings llama.cpp's converter writes."""
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    directory, name = os.path.split(path)
    config = {} if original is None else {"config": AutoConfig.from_pretrained(original)}
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True), **config)
    return model.eval(), load_gguf_tokenizer(path)


@torch.no_grad()
def _hf_greedy(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    input_ids = torch.tensor([ids])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), out.logits[0][0].float()


@pytest.mark.parametrize("arch,weight_type", [
    ("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"), ("llama", "Q4_0"),
    ("qwen2", "F32"), ("qwen2", "Q8_0"), ("qwen3", "Q4_1"), ("llama256", "Q4_K"), ("llama256", "Q6_K"),
    ("gemma2", "F32"), ("gemma2", "Q8_0"), ("gemma3", "F32"), ("gemma3", "Q8_0"), ("phi3", "F32"), ("phi3", "Q8_0"),
    ("qwen3_moe", "F32"), ("qwen3_moe", "Q8_0"),
])
def test_greedy_tokens_and_logits_equal_transformers_on_the_same_file(models, tmp_path, arch, weight_type):
    path = write_gguf(models[arch], str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type)
    reference, tokenizer = _hf_reference(path, models[arch])
    llm = LLM(model=path, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids
        tokens, first_logits = _hf_greedy(reference, ids)
        assert out.outputs[0].token_ids == tokens, (prompt, weight_type)
        ours = out.outputs[0].logprobs[0][tokens[0]].logprob
        assert ours == pytest.approx(torch.log_softmax(first_logits, -1)[tokens[0]].item(), abs=1e-4)


def test_quantizing_an_already_quantized_file_says_what_it_costs(models, tmp_path, caplog):
    path = write_gguf(models["llama"], str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    logging.getLogger("pagedllm").addHandler(caplog.handler)  # pagedllm's logger does not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            LLM(model=path, dtype="float32", quantization="int8")
    finally:
        logging.getLogger("pagedllm").removeHandler(caplog.handler)
    assert any("re-quantizes" in r.getMessage() and "Q8_0" in r.getMessage() for r in caplog.records)


def test_q8_0_projections_stay_packed_as_int8(models, tmp_path):
    from pagedllm.layers.quantization import QuantizedWeight
    from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled

    path = write_gguf(models["llama"], str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    llm = LLM(model=path, dtype="float32")
    model = llm.llm_engine.model_runner.model
    attn = model.layers[0].self_attn
    weight = attn.qkv_proj.weight
    assert isinstance(weight, QuantizedWeight)
    if kernel_enabled(torch.float32):  # pagedllm's kernel: q + 128 with the file's fp16 scales, no mins
        assert isinstance(weight, VnniWeight) and (weight.bits, weight.symmetric, weight.group_size) == (8, True, 32)
        assert weight.scales.dtype == torch.float16
    else:  # torch's int8 kernel's form
        assert weight.qweight.dtype == torch.int8
        assert tuple(weight.scales.shape) == (weight.shape[0], 64 // 32)


def test_tokenizer_from_metadata_encodes_like_the_original(models, tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(models["llama"], str(tmp_path / "tiny.gguf"), "F32")
    original = AutoTokenizer.from_pretrained(models["llama"])
    rebuilt = load_gguf_tokenizer(path)
    corpus = training_text()[:20000].splitlines() + ["  leading spaces", "ünïcödé 日本語 ✓", "a\tb\r\nc"]
    for line in corpus:
        assert rebuilt.encode(line, add_special_tokens=False) == original.encode(line, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert rebuilt.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rebuilt.eos_token == original.eos_token


def test_a_directory_with_one_gguf_file_loads_and_names_it(models, tmp_path):
    from pagedllm.entrypoints.openai.server import default_served_model_name

    directory = tmp_path / "holder"
    directory.mkdir()
    path = write_gguf(models["qwen2"], str(directory / "tiny-qwen.gguf"), "F32")
    assert resolve_gguf_file(str(directory)) == path
    assert default_served_model_name(path) == "tiny-qwen"
    llm = LLM(model=str(directory), dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    shutil.copy(path, directory / "second.gguf")
    with pytest.raises(ValueError, match="2 GGUF files"):
        LLM(model=str(directory))


def test_bad_gguf_inputs_are_named_errors(models, tmp_path):
    split = tmp_path / "model-00001-of-00002.gguf"
    shutil.copy(write_gguf(models["llama"], str(tmp_path / "a.gguf"), "F32"), split)
    with pytest.raises(ValueError, match="split GGUF"):
        LLM(model=str(split))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing.gguf"))


def test_quantization_int8_applies_to_a_gguf_model(models, tmp_path):
    from pagedllm.layers.quantization import QuantizedWeight
    from pagedllm.layers.quantization.vnni import VnniWeight

    path = write_gguf(models["llama"], str(tmp_path / "tiny-F32.gguf"), "F32")
    llm = LLM(model=path, dtype="float32", quantization="int8")
    weight = llm.llm_engine.model_runner.model.layers[0].mlp.down_proj.weight
    assert isinstance(weight, QuantizedWeight)
    per_channel = weight.group_size == weight.shape[1] if isinstance(weight, VnniWeight) else weight.scales.dim() == 1
    assert per_channel  # as asked
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_unsupported_gguf_architecture_is_a_named_error(models, tmp_path):
    path = write_gguf(models["llama"], str(tmp_path / "tiny.gguf"), "F32", arch_name="starcoder2")
    with pytest.raises(ValueError, match="starcoder2"):
        LLM(model=path)


@pytest.mark.slow
def test_serve_a_gguf_file_under_its_name(models, tmp_path):
    from test_server import RemoteServer

    path = write_gguf(models["qwen2"], str(tmp_path / "tiny-qwen.gguf"), "Q8_0")
    server = RemoteServer(path, tmp_path, served_model_name=None)
    try:
        client = server.client()
        assert [model.id for model in client.models.list().data] == ["tiny-qwen"]
        reply = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, temperature=0.0)
        assert reply.usage.completion_tokens > 0
    finally:
        assert server.terminate() == 0, server.log()


def test_gemma3_global_rope_scaling_and_local_base_come_from_the_metadata(models, tmp_path):
    """llama.cpp writes Gemma 3's linear RoPE scaling (4B and up) and local base; transformers' GGUF map
    drops both, so pagedllm reads them itself."""
    import gguf

    from pagedllm.config import ModelConfig
    from pagedllm.models.gemma import gemma3_rope_configs

    path = write_gguf(models["gemma3"], str(tmp_path / "tiny-rope.gguf"), metadata=dict(
        rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=8.0, rope_freq_base_swa=20000.0))
    global_rope, local_rope = gemma3_rope_configs(ModelConfig.from_pretrained(path).hf_config)
    assert global_rope.scaling == {"rope_type": "linear", "factor": 8.0} and local_rope.theta == 20000.0
    assert local_rope.scaling is None


def test_a_generation_config_beside_the_file_gives_its_default_sampling(models, tmp_path):
    path = write_gguf(models["llama"], str(tmp_path / "tiny-F32.gguf"), "F32")
    assert LLM(model=path, dtype="float32").get_default_sampling_params().max_tokens == 16  # none: vLLM's
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "max_new_tokens": 7}')
    params = LLM(model=path, dtype="float32").get_default_sampling_params()
    assert params.temperature == 0.0 and params.max_tokens == 7


def test_plan_reads_a_gguf_file_and_counts_its_stored_bytes(models, tmp_path):
    """`pagedllm plan --model file.gguf`: the file's metadata gives the shape, and the weights count at the
    bytes the file stores them in (the engine keeps them packed), not in the activation dtype."""
    from pagedllm.planner import roofline as rl
    from pagedllm.planner.cli import PlanInputs, build_plan
    from pagedllm.planner.hardware import get_hardware
    from pagedllm.planner.presets import load_model_spec

    path = write_gguf(models["llama256"], str(tmp_path / "tiny-Q4_0.gguf"), "Q4_0")
    spec = load_model_spec(path)
    assert load_model_spec(str(tmp_path)).stored_weight_bytes == spec.stored_weight_bytes  # its directory
    dense = load_model_spec(models["llama256"])
    assert (spec.num_layers, spec.hidden_size, spec.num_params) == (dense.num_layers, dense.hidden_size,
                                                                    dense.num_params)
    held, read = spec.stored_weight_bytes
    assert read < held < rl.weight_bytes(dense, 2) / 3  # untied: a step reads its embedding by rows
    plan = build_plan(spec, get_hardware("h100-sxm", "bfloat16"), PlanInputs(context=64))
    assert plan["model"]["weight_bytes"] == pytest.approx(held)
    assert plan["model"]["weight_dtype"].startswith("as stored")
    assert build_plan(spec, get_hardware("h100-sxm", "bfloat16"),
                      PlanInputs(context=64, dtype="bfloat16"))["model"]["weight_bytes"] > 3 * held
