"""The resident memory a model takes, counted honestly: everything the engine imports and initializes is
loaded first (torch, transformers, gguf, tokenizers, pagedllm's C++ kernels, the model's config and
attention backend), then only the model is loaded, and the growth of the resident set is reported against
the checkpoint file's size. No KV cache is allocated (it is excluded: the engine sizes it separately),
and no step runs.

    python tools/model_memory.py [--model FILE.gguf] [--dtype bfloat16]

Prints the growth of VmRSS, split into anonymous memory (weights copied or repacked into the process)
and file-backed pages (the file where it stays mapped, and library code first run during the load), the
peak during the load (transient copies), and the bytes of the tensors the model holds.
"""

from __future__ import annotations

import argparse
import gc
import os
from dataclasses import dataclass


def _status() -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of this process in MiB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                values[key] = int(rest.split()[0]) / 1024
    return values


def _reset_peak() -> bool:
    """Start VmHWM (the peak resident set) again from the current one; False where Linux refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _import_everything() -> None:
    """What loading any model imports or initializes, so that none of it is counted as the model's."""
    import gguf  # noqa: F401
    import numpy  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from gguf import GGUFReader  # noqa: F401
    from gguf.quants import dequantize  # noqa: F401

    import pagedllm.llm  # noqa: F401
    import pagedllm.models.gguf  # noqa: F401
    import pagedllm.models.loader  # noqa: F401
    from pagedllm.cpu_kernels import load_cpu_kernels

    load_cpu_kernels()


def model_tensor_bytes(model) -> int:
    """Bytes of the distinct storages of the model's parameters, buffers and packed weights."""
    import torch

    seen: dict[int, int] = {}
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        tensors += [value for value in vars(module).values() if isinstance(value, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


@dataclass
class MemoryReport:
    file_mib: float
    rss_mib: float  # growth of VmRSS from loading the model
    anon_mib: float
    file_backed_mib: float
    tensors_mib: float
    peak_mib: float | None  # growth of the peak resident set during the load (transient copies included)

    @property
    def ratio(self) -> float:
        return self.rss_mib / self.file_mib

    def describe(self) -> str:
        return (f"file {self.file_mib:.1f} MiB; resident set growth from loading the model: {self.rss_mib:.1f} MiB "
                f"= {self.ratio:.2f}x the file (anonymous {self.anon_mib:.1f} MiB, file-backed "
                f"{self.file_backed_mib:.1f} MiB); peak during the load: "
                f"{'unknown' if self.peak_mib is None else f'+{self.peak_mib:.1f} MiB'}; tensors the model holds: "
                f"{self.tensors_mib:.1f} MiB; "
                f"KV cache: not allocated (excluded); libraries, kernels and config loaded before counting")


def measure(path: str, dtype: str = "bfloat16") -> MemoryReport:
    """Load the model at `path` once, after everything else is loaded, and report what it added."""
    _import_everything()
    import torch

    from pagedllm.attention.selector import get_attn_backend
    from pagedllm.config import ModelConfig
    from pagedllm.models.loader import load_model
    from pagedllm.platform import release_free_heap_memory

    device = torch.device("cpu")
    config = ModelConfig.from_pretrained(path, dtype=dtype)
    backend = get_attn_backend(None, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                               config.dtype, config.dtype, device, 16)
    gc.collect()
    release_free_heap_memory()
    peak_known = _reset_peak()
    before = _status()
    model = load_model(config, backend, device)
    gc.collect()
    after = _status()
    report = MemoryReport(os.path.getsize(path) / 2**20, after["VmRSS"] - before["VmRSS"],
                          after["RssAnon"] - before["RssAnon"], after["RssFile"] - before["RssFile"],
                          model_tensor_bytes(model) / 2**20,
                          after["VmHWM"] - before["VmRSS"] if peak_known else None)
    del model
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file or a model directory (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    path = args.model
    if path is None:
        from pagedllm.assets import default_model_path

        path = default_model_path()
    print(measure(path, args.dtype).describe())


if __name__ == "__main__":
    main()
