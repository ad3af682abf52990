"""ModelConfig reads what published checkpoints write, and refuses what the engine cannot serve right."""

from __future__ import annotations

import json

import pytest
from tiny_models import build_model

from pagedllm.config import ModelConfig


def _with_config(path: str, **changes) -> str:
    config_file = f"{path}/config.json"
    with open(config_file) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return path


def test_sliding_window_is_served_not_capped(tmp_path) -> None:
    # The window is attention's, not the context's: every layer of this Mistral slides over 64 tokens,
    # and the context stays max_position_embeddings long.
    model = _with_config(build_model(tmp_path / "m", arch="mistral"), sliding_window=64)
    config = ModelConfig.from_pretrained(model)
    assert config.max_model_len > 64
    assert [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)] == [64, 64]
    assert ModelConfig.from_pretrained(model, max_model_len=100).max_model_len == 100


def test_qwen2_sliding_window_off_is_ignored(tmp_path) -> None:
    model = _with_config(build_model(tmp_path / "q", arch="qwen2"), sliding_window=64, use_sliding_window=False)
    config = ModelConfig.from_pretrained(model)
    assert config.max_model_len > 64 and config.sliding_window is None
    assert config.layer_sliding_window(0) is None


def test_unsupported_rope_type_names_the_supported_ones(tmp_path) -> None:
    model = _with_config(build_model(tmp_path / "r", arch="llama"),
                         rope_scaling={"rope_type": "ntk-by-parts", "factor": 4.0}, rope_parameters=None)
    from pagedllm import LLM

    with pytest.raises(ValueError, match="linear"):
        LLM(model=model)
