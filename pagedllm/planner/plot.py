"""`pagedllm plan --plot FILE.png`: KV-cache memory against context length, per attention variant, dtype."""

from __future__ import annotations

from pathlib import Path

from pagedllm.planner.roofline import ModelSpec, dtype_bytes, kv_bytes_per_token, kv_variants

DEFAULT_PLOT_DTYPES = ("bfloat16", "fp8")


def plot_kv_memory(
    spec: ModelSpec,
    batch: int,
    out_path: str | Path,
    max_context: int = 131072,
    kv_memory_bytes: float | None = None,
    dtypes: tuple[str, ...] = DEFAULT_PLOT_DTYPES,
) -> Path:
    """Draw KV bytes for `batch` sequences from 1k to max_context tokens, one line per variant x dtype;
    a horizontal line marks the memory left for KV, where known."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; the plot goes to a file
    import matplotlib.pyplot as plt

    contexts = [1024 * 2**i for i in range(max(1, (max_context // 1024).bit_length()))]
    if contexts[-1] < max_context:
        contexts.append(max_context)
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":", "-."]
    for (variant, variant_spec), color in zip(kv_variants(spec).items(), ["C0", "C1", "C2", "C3"]):
        for dtype, style in zip(dtypes, styles):
            per_token = kv_bytes_per_token(variant_spec, dtype_bytes(dtype))
            gigabytes = [per_token * ctx * batch / 1e9 for ctx in contexts]
            ax.plot(
                contexts,
                gigabytes,
                style,
                color=color,
                marker="o",
                markersize=3,
                label=f"{variant} {dtype} ({per_token / 1024:,.0f} KiB/token)",
            )
    if kv_memory_bytes is not None and kv_memory_bytes > 0:
        ax.axhline(kv_memory_bytes / 1e9, color="black", linewidth=1)
        ax.annotate("memory left for KV", (contexts[0], kv_memory_bytes / 1e9), va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"KV cache for batch {batch} (GB)")
    ax.set_title(f"{spec.name}: {spec.num_layers} layers, {spec.num_attention_heads} query heads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
