"""The bundled demo models load offline with transformers and match what their model cards claim."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bundled models must never need the network

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.assets import default_draft_path, default_model_path

TARGET_DIR, DRAFT_DIR = Path(default_model_path()), Path(default_draft_path())
# Losses are recomputed in fp32 from the same bf16 weights and token ids as on the card; only
# floating-point summation order differs between machines.
LOSS_TOLERANCE = 0.02


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((TARGET_DIR / "training_results.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {
        name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True).eval()
        for name, d in (("target", TARGET_DIR), ("draft", DRAFT_DIR))
    }


@pytest.fixture(scope="module")
def val_slice() -> torch.Tensor:
    return torch.tensor(json.loads((TARGET_DIR / "val_slice.json").read_text())["windows"])


def test_default_paths_point_at_complete_hf_dirs() -> None:
    for d in (TARGET_DIR, DRAFT_DIR):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "README.md"):
            assert (d / name).is_file(), d / name
        config = json.loads((d / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["max_position_embeddings"] >= 2048
        generation = json.loads((d / "generation_config.json").read_text())
        assert generation["do_sample"] is False
        assert generation["eos_token_id"] == config["eos_token_id"]
        with safe_open(d / "model.safetensors", "pt") as f:
            assert all(f.get_slice(k).get_dtype() in ("BF16", "F16") for k in f.keys())
    # The tokenizer is duplicated so that each directory is self-contained.
    assert (TARGET_DIR / "tokenizer.json").read_bytes() == (DRAFT_DIR / "tokenizer.json").read_bytes()
    size = sum(p.stat().st_size for d in (TARGET_DIR, DRAFT_DIR) for p in d.iterdir())
    assert size < 40e6


def test_shapes_and_parameter_counts(models: dict[str, torch.nn.Module]) -> None:
    target, draft = models["target"], models["draft"]
    assert target.config.num_key_value_heads < target.config.num_attention_heads  # GQA
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 10e6 <= n_target <= 30e6
    assert 1e6 <= n_draft <= 3e6
    assert target.config.vocab_size == draft.config.vocab_size


def test_tokenizer_special_tokens_and_round_trip(tokenizer) -> None:
    assert len(tokenizer) <= 8192
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    ids = tokenizer("def f():")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 1
    text = "def f(x):\n\treturn {'a': x}  # naïve ☃\n\n\n    pass\r\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "import os"}], tokenize=False)
    assert chat.endswith("import os")
    draft_tokenizer = AutoTokenizer.from_pretrained(DRAFT_DIR, local_files_only=True)
    assert draft_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]


@torch.no_grad()
def slice_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    logits = model(windows[:, :-1]).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


def test_validation_loss_matches_card(models: dict, val_slice: torch.Tensor, results: dict) -> None:
    assert val_slice[:, 1:].numel() >= 2000
    uniform = math.log(results["vocab_size"])
    losses = {name: slice_loss(model, val_slice) for name, model in models.items()}
    card = (TARGET_DIR / "README.md").read_text()
    for name, loss in losses.items():
        assert loss == pytest.approx(results[name]["val_slice_loss"], abs=LOSS_TOLERANCE)
        assert f"{results[name]['val_loss']:.3f}" in card  # the card shows what the results file says
        assert loss < uniform - 3.0, f"{name} is barely better than a uniform guess"
    assert losses["target"] < losses["draft"] - 0.1


@torch.no_grad()
def test_greedy_agreement_matches_card(models: dict, val_slice: torch.Tensor, results: dict) -> None:
    inputs = val_slice[:, :-1]
    agreement = (models["target"](inputs).logits.argmax(-1) == models["draft"](inputs).logits.argmax(-1))
    assert agreement.float().mean().item() == pytest.approx(results["slice_agreement"], abs=0.02)
    assert 0.0 < results["agreement"] <= 1.0
    assert f"{results['agreement']:.3f}" in (TARGET_DIR / "README.md").read_text()


def test_target_greedy_completion_looks_like_python(models: dict, tokenizer) -> None:
    inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
    out = models["target"].generate(**inputs, max_new_tokens=48, do_sample=False)
    completion = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert completion.startswith("\n")  # a def's body goes on the next line
    assert "\n    " in completion  # ... indented
