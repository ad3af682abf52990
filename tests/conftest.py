"""Shared test setup: offline Hugging Face, quiet tokenizers, few threads, and tiny model fixtures.

Builders live in tiny_models.py (importable); the fixtures here build one model per session so test
files can share it. Every model is random-weight and built in a tmp dir; nothing touches the network.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# The default model (a command given no model) is the bundled demo model in every test, whatever this
# machine has cached: the models dir is an empty one. tests/test_real_model.py fetches the real file
# into the user's cache, kept here, so it is downloaded once per machine, not once per run.
import tempfile  # noqa: E402

from pagedllm.assets import models_dir  # noqa: E402

REAL_MODELS_DIR = str(models_dir())
os.environ["PAGEDLLM_MODELS_DIR"] = tempfile.mkdtemp(prefix="pagedllm-no-models-")
# The CPU linear kernel is the static default (the blocked kernel where it runs), not one measured at each
# model's first start: no timing in tests, and the same path whatever this machine's load.
# tests/test_linear_tuning.py turns the measurement on with a tiny budget.
os.environ["PAGEDLLM_CPU_TUNE"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import build_model, build_tiny_vocab_model  # noqa: E402

# Tiny models are dominated by per-operator overhead, and on a shared 2-core box a second OpenMP thread
# spins against other jobs: HF generate of 32 tokens measured 1.44 s with 2 threads, 0.29 s with 1.
torch.set_num_threads(int(os.environ.get("PAGEDLLM_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random Llama (hidden 64, 2 layers, GQA 4/2 heads, fp32, BPE vocab 512) with a chat template."""
    return build_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random Qwen2 (qkv bias, tied embeddings), otherwise like tiny_llama_dir."""
    return build_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def tiny_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random Llama over 12 token ids (WordLevel tokenizer) for distribution tests."""
    return build_tiny_vocab_model(tmp_path_factory.mktemp("tiny_vocab"), vocab_size=12)
