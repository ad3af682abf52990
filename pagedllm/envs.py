"""Every environment variable pagedllm reads, in one place (as vLLM keeps vllm/envs.py): its name, type,
default and what it does. Code reads a value through `envs.value(NAME)`, which parses it and names the
variable in the error when it cannot; `pagedllm --help-env` prints this table. Variables that must act
before torch loads (the OpenMP wait policy) are the standard `OMP_*` / `GOMP_*` ones, not listed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: type  # str, bool, float
    default: Any
    doc: str


ENV_VARS: dict[str, EnvVar] = {var.name: var for var in [
    EnvVar("PAGEDLLM_CACHE_DIR", str, None,
           "root of pagedllm's cache: compiled CPU kernels and fetched models (default: "
           "$XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm)"),
    EnvVar("PAGEDLLM_MODELS_DIR", str, None, "where fetched models live (default: PAGEDLLM_CACHE_DIR/models)"),
    EnvVar("PAGEDLLM_OFFLINE", bool, False,
           "never fetch the default model (HF_HUB_OFFLINE does the same): with nothing cached, commands fall "
           "back to the bundled demo model"),
    EnvVar("PAGEDLLM_LOGGING_LEVEL", str, "INFO", "log level of pagedllm's loggers; DEBUG also shows tracebacks"),
    EnvVar("PAGEDLLM_API_KEY", str, None, "the server's API key when --api-key is not given"),
    EnvVar("VLLM_ALLOW_RUNTIME_LORA_UPDATING", bool, False,
           "vLLM's switch for the server's /v1/load_lora_adapter and /v1/unload_lora_adapter, as "
           "--allow-runtime-lora-updating"),
    EnvVar("PAGEDLLM_ATTENTION_BACKEND", str, None,
           "attention backend when attention_backend is not given: TORCH_SDPA, TORCH_FLASH, CPU_FLASH, TRITON"),
    EnvVar("PAGEDLLM_SKIP_KERNEL_BUILD", bool, False,
           "`pip install` leaves the C++ CPU ops to be compiled at first use instead of now (setup.py)"),
    EnvVar("PAGEDLLM_GGUF_DEQUANTIZE", bool, False,
           "GGUF files: dequantize every block type into the model dtype on load, none kept packed "
           "(Q8_0, Q4_0, Q4_1, Q4_K); the reference the packed kernels are checked against"),
    EnvVar("PAGEDLLM_DISABLE_CPU_KERNELS", bool, False,
           "never build or load the C++ CPU ops: every op runs its plain-torch path"),
    EnvVar("PAGEDLLM_CPU_PREPACK_WEIGHTS", str, "1",
           "CPU linear kernel: 1 the fastest measured on this CPU (layers/linear_tuning.py), blocked "
           "pagedllm's blocked kernel, amx the same on AMX tiles (bf16), onednn oneDNN's prepacked layout, "
           "0 plain F.linear"),
    EnvVar("PAGEDLLM_CPU_TUNE", bool, True,
           "time the CPU linear kernels on a model's shapes at its first start (at most 8 s, cached beside "
           "the compiled kernels); 0 takes the static default (the blocked kernel, on AMX tiles for bf16 "
           "where the CPU has them) untimed"),
    EnvVar("PAGEDLLM_QUANT_KERNEL", str, "auto",
           "int4 / int8 weight-only linears on CPU: auto (pagedllm's VNNI kernel where the CPU has AVX512-VNNI, "
           "else torch's), pagedllm, or torch (torch's _weight_int4pack_mm / _weight_int8pack_mm paths)"),
    EnvVar("PAGEDLLM_QUANT_ACTIVATION_TERMS", str, "2",
           "pagedllm's VNNI kernel: int8 terms per block of 32 activations, 2 (about 15 bits, as faithful as "
           "bf16) or 1 (llama.cpp's Q8_0: about 8 bits, half the integer products, faster batches and prefill)"),
    EnvVar("PAGEDLLM_QUANT_PROMPT_ROWS", str, "auto",
           "pagedllm's VNNI kernel, bf16 models: how prompt rows are multiplied, auto (dense where the CPU has "
           "AMX tiles, else integer), dense (the weights rounded to bf16 a block at a time, bf16 products) or "
           "integer (as generated rows: quantized activations, integer products)"),
    EnvVar("PAGEDLLM_CPU_HUGE_PAGES", bool, True, "advise 2 MiB transparent huge pages for packed CPU weights"),
    EnvVar("PAGEDLLM_CPU_MALLOC_TUNING", bool, True,
           "keep freed memory in glibc's heap (no fresh mmap per large activation)"),
    EnvVar("PAGEDLLM_CPU_KVCACHE_SPACE", float, None,
           "the CPU KV cache in GiB, exactly (default: the smallest of 4 GiB, what max_num_seqs x max_model_len "
           "needs, and gpu_memory_utilization of the memory available)"),
    EnvVar("PAGEDLLM_ENGINE_CORE_STARTUP_TIMEOUT_S", float, 900.0,
           "seconds the server waits for its engine core process to load the model"),
    EnvVar("PAGEDLLM_WORKER_STARTUP_TIMEOUT_S", float, 600.0, "seconds the engine waits for a worker process to start"),
    EnvVar("PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S", float, 600.0, "seconds the engine waits for a worker's step"),
]}


def is_set(name: str) -> bool:
    assert name in ENV_VARS, f"{name} is not a pagedllm environment variable (add it to envs.ENV_VARS)"
    return os.environ.get(name, "").strip() != ""


def value(name: str) -> Any:
    """The variable's value, parsed by its type; its default when unset or empty. A ValueError names it
    when the text cannot be parsed."""
    var = ENV_VARS[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return var.default
    if var.kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{name} must be one of {'/'.join(_TRUE + _FALSE)}, got {raw!r}.")
    if var.kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {raw!r}.") from None
    return raw


def help_text() -> str:
    """The table `pagedllm --help-env` prints."""
    width = max(len(name) for name in ENV_VARS)
    lines = ["Environment variables pagedllm reads:", ""]
    for var in ENV_VARS.values():
        default = "" if var.default is None else f" (default: {var.default})"
        lines.append(f"  {var.name:<{width}}  {var.doc}{default}")
    return "\n".join(lines)
