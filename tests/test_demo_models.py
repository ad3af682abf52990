"""The bundled demo models load offline with transformers and match what their model cards claim.

The cards' numbers are recomputed from the weights: held-out loss and greedy agreement on the
validation split rebuilt from the standard library on disk, as the training script split it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bundled models must never need the network

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.assets import demo_draft_path, demo_model_path

TARGET_DIR, DRAFT_DIR = Path(demo_model_path()), Path(demo_draft_path())
REPO_ROOT = Path(__file__).resolve().parents[1]
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
    assert size < 60e6


def test_shapes_and_parameter_counts(models: dict[str, torch.nn.Module]) -> None:
    target, draft = models["target"], models["draft"]
    for model in (target, draft):
        # Whole KV heads on every rank for tensor_parallel_size 1, 2 and 4.
        assert model.config.num_attention_heads % 4 == 0 and model.config.num_key_value_heads % 4 == 0
    assert target.config.num_key_value_heads < target.config.num_attention_heads  # GQA
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 5e6 <= n_target <= 30e6
    assert 0.5e6 <= n_draft <= n_target / 5
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers  # a draft step must be cheap
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


# What the weights give (fp32, as computed here) and the bounds the tests hold them to. The card's
# held-out windows (64 of 256 tokens over the library files the training split holds out): target
# 3.2512, draft 3.6195, greedy agreement 0.6136; its first 12 windows, shipped as val_slice.json:
# 2.9982, 3.4030, 0.6432. Machines differ by about 1e-4 (summation order); the margins (0.05 nats,
# 0.02 agreement) are far above that, so a bound fails only if the weights or the held-out text change.
HELD_OUT_BOUNDS = {"target": 3.30, "draft": 3.67, "agreement": 0.59}
SLICE_BOUNDS = {"target": 3.05, "draft": 3.45, "agreement": 0.62}


@torch.no_grad()
def losses_and_agreement(models: dict, windows: torch.Tensor) -> tuple[dict[str, float], float]:
    """Each model's mean next-token loss over the windows, and the fraction of positions where the
    draft's argmax is the target's (teacher-forced on the same text), as tools/train_demo_models.py
    computes the card's numbers."""
    total = dict.fromkeys(models, 0.0)
    same = 0
    for chunk in windows.split(8):  # 8 windows at a time: logits of all 64 would take 1 GB
        inputs, labels = chunk[:, :-1], chunk[:, 1:].flatten()
        logits = {name: model(inputs).logits.float() for name, model in models.items()}
        for name, values in logits.items():
            total[name] += F.cross_entropy(values.flatten(0, 1), labels, reduction="sum").item()
        same += (logits["target"].argmax(-1) == logits["draft"].argmax(-1)).sum().item()
    count = windows[:, 1:].numel()
    return {name: value / count for name, value in total.items()}, same / count


@pytest.fixture(scope="module")
def held_out_windows(results: dict, val_slice: torch.Tensor) -> torch.Tensor:
    """The card's validation windows, rebuilt from this Python's standard library as
    tools/train_demo_models.py built them: the library files its path hash holds out of training
    (split seed 0, the default every recorded command used), one token stream, evenly spaced windows."""
    from tokenizers import Tokenizer

    script = load_training_script()
    _, val_texts, _, _ = script.load_corpus(seed=0)
    stream = script.encode_documents(Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json")), val_texts)
    seq_len = script.TrainArgs(steps=1, lr=0).seq_len
    windows = script.val_windows(stream, seq_len, results["val_tokens"] // seq_len)
    if not torch.equal(windows[: len(val_slice), : val_slice.shape[1]], val_slice):
        pytest.skip(f"this Python's standard library ({sys.version.split()[0]}) is not the one the card's "
                    f"held-out text came from ({results['python']}); val_slice.json is still checked")
    return windows


def test_held_out_loss_and_agreement(models: dict, held_out_windows: torch.Tensor, results: dict) -> None:
    assert held_out_windows[:, 1:].numel() == results["val_tokens"] == 16_384
    losses, agreement = losses_and_agreement(models, held_out_windows)
    assert losses["target"] <= HELD_OUT_BOUNDS["target"], losses
    assert losses["draft"] <= HELD_OUT_BOUNDS["draft"], losses
    assert agreement >= HELD_OUT_BOUNDS["agreement"], agreement
    assert losses["target"] < losses["draft"] - 0.1
    # The results file and the card say what the weights give.
    card = (TARGET_DIR / "README.md").read_text()
    for name, loss in losses.items():
        assert loss == pytest.approx(results[name]["val_loss"], abs=LOSS_TOLERANCE)
        assert f"{results[name]['val_loss']:.3f}" in card
    assert agreement == pytest.approx(results["agreement"], abs=0.01)
    assert f"{results['agreement']:.3f}" in card


def test_committed_slice_loss_and_agreement(models: dict, val_slice: torch.Tensor, results: dict) -> None:
    """The first held-out windows, shipped as token ids, so this holds on any Python."""
    assert val_slice[:, 1:].numel() >= 2000
    losses, agreement = losses_and_agreement(models, val_slice)
    assert losses["target"] <= SLICE_BOUNDS["target"], losses
    assert losses["draft"] <= SLICE_BOUNDS["draft"], losses
    assert agreement >= SLICE_BOUNDS["agreement"], agreement
    uniform = math.log(results["vocab_size"])
    for name, loss in losses.items():
        assert loss < uniform - 3.0, f"{name} is barely better than a uniform guess"
        assert loss == pytest.approx(results[name]["val_slice_loss"], abs=LOSS_TOLERANCE)
    assert agreement == pytest.approx(results["slice_agreement"], abs=0.02)


def test_the_bounds_catch_damaged_weights(models: dict, val_slice: torch.Tensor) -> None:
    # One of six layers' MLP output zeroed: the slice loss rises by about 0.13 nats, past its bound.
    import copy

    damaged = copy.deepcopy(models["target"])
    with torch.no_grad():
        damaged.model.layers[2].mlp.down_proj.weight.zero_()
    losses, _ = losses_and_agreement({"target": damaged, "draft": models["draft"]}, val_slice)
    assert losses["target"] > SLICE_BOUNDS["target"]


def test_target_greedy_completion_looks_like_python(models: dict, tokenizer) -> None:
    inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
    out = models["target"].generate(**inputs, max_new_tokens=48, do_sample=False)
    completion = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert completion.startswith("\n")  # a def's body goes on the next line
    assert "\n    " in completion  # ... indented


def load_training_script():
    """tools/train_demo_models.py, where the card's "first top-level block" rule is defined."""
    spec = importlib.util.spec_from_file_location("train_demo_models", REPO_ROOT / "tools" / "train_demo_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_first_top_level_block_rule() -> None:
    script = load_training_script()
    prompt = "def f(n):"
    # Ends at the next line that starts at column 0; blank lines inside the block do not end it.
    assert script.first_top_level_block("def f(n):\n    a = 1\n\n    return a\nprint(1)", prompt) == (
        "def f(n):\n    a = 1\n\n    return a", True)
    # "import os\n\ndef ": the block is the def the prompt opens, not the import line alone.
    text = "import os\n\ndef g():\n    pass\nclass A: 1("
    assert script.first_top_level_block(text, "import os\n\ndef ") == ("import os\n\ndef g():\n    pass", True)
    assert script.block_parses(text, "import os\n\ndef ")
    assert not script.block_parses("import os\n\ndef g(:\n    pass\nx = 1", "import os\n\ndef ")
    # A block cut by the token limit counts if it parses without its last, cut line ...
    assert script.block_parses("def f(n):\n    return n\n    x = (1,", prompt)
    # ... but not when nothing of the body is left.
    assert not script.block_parses("def f(n):\n    x = (1,", prompt)
    assert not script.block_parses("def f(n):\n", prompt)


@pytest.mark.slow
def test_cli_greedy_completions_parse(results: dict) -> None:
    """`pagedllm generate` (greedy, fp32 so the result does not depend on the CPU's bf16 support) on the
    card's five prompts: the first top-level block of prompt + completion is valid Python."""
    script = load_training_script()
    prompts = script.SAMPLE_PROMPTS
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--model", str(TARGET_DIR), "--json",
           "--dtype", "float32",
           "--temperature", "0", "--max-tokens", str(results["sample_max_tokens"]),
           *prompts]  # passed verbatim: "import os\n\ndef " holds real newlines
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [line["prompt"] for line in lines] == prompts
    texts = [line["prompt"] + line["text"] for line in lines]
    parsed = [script.block_parses(text, prompt) for text, prompt in zip(texts, prompts)]
    # The engine reproduces the card's fp32 samples (up to floating-point summation order).
    assert parsed == results["parses"]["target"], texts
    # The goal is 4 of 5; this target gets all 5 (the earlier one, trained on the library alone, got 1).
    assert sum(parsed) >= 4, texts
