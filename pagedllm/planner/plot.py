"""`pagedllm plan --plot FILE.png`: KV-cache memory against context length, per attention variant, in the
run's KV dtype, with the requested context x batch marked and the memory left for KV drawn."""

from __future__ import annotations

from pathlib import Path

from pagedllm.planner.roofline import ModelSpec, dtype_bytes, kv_bytes_per_token, kv_variants

_MARKERS = ["o", "s", "^", "D", "v", "P"]


def per_token_label(num_bytes: float) -> str:
    """Exact bytes per token, with KiB/MiB only as a readable aside (never rounded to a whole KiB)."""
    if num_bytes < 1024:
        return f"{num_bytes:,.0f} B/token"
    if num_bytes < 2**20:
        return f"{num_bytes:,.0f} B/token ({num_bytes / 1024:,.4g} KiB)"
    return f"{num_bytes:,.0f} B/token ({num_bytes / 2**20:,.4g} MiB)"


def plot_kv_memory(
    spec: ModelSpec,
    batch: int,
    out_path: str | Path,
    max_context: int = 131072,
    kv_memory_bytes: float | None = None,
    kv_dtype: str = "bfloat16",
    context: int | None = None,
    weight_bytes: float | None = None,
    memory_bytes: float | None = None,
) -> Path:
    """Draw KV bytes for `batch` sequences from 1k to max_context tokens, one line per attention variant
    in `kv_dtype`. Lines of variants that cache the same bytes coincide; each variant has its own marker
    and its legend entry names the variants it overlaps. `context` marks the requested point; a
    horizontal line marks the memory left for KV, or a note says the weights do not fit."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; the plot goes to a file
    import matplotlib.pyplot as plt

    contexts = [1024 * 2**i for i in range(max(1, (max_context // 1024).bit_length()))]
    if contexts[-1] < max_context:
        contexts.append(max_context)
    fig, ax = plt.subplots(figsize=(8, 5))
    element = dtype_bytes(kv_dtype)
    per_token = {name: kv_bytes_per_token(variant, element) for name, variant in kv_variants(spec).items()}
    own = spec.attention_kind
    for index, (name, num_bytes) in enumerate(per_token.items()):
        same = [other for other in per_token if other != name and per_token[other] == num_bytes]
        label = f"{name}{' (this model)' if name == own else ''}: {per_token_label(num_bytes)}"
        if same:
            label += f", same as {', '.join(same)}"
        ax.plot(contexts, [num_bytes * ctx * batch / 1e9 for ctx in contexts], color=f"C{index}",
                marker=_MARKERS[index % len(_MARKERS)], markersize=9 - 2 * index, markevery=1,
                linewidth=3.0 - 0.6 * index, alpha=0.85, label=label)
    if context is not None:
        wanted = per_token.get(own, next(iter(per_token.values()))) * context * batch / 1e9
        ax.axvline(context, color="gray", linestyle=":", linewidth=1)
        ax.plot([context], [wanted], marker="*", markersize=16, color="black", linestyle="none",
                label=f"requested: {context:,} tokens x batch {batch} = {wanted:,.3g} GB ({own})")
    if kv_memory_bytes is not None and kv_memory_bytes > 0:
        ax.axhline(kv_memory_bytes / 1e9, color="black", linewidth=1)
        ax.annotate(f"memory left for KV: {kv_memory_bytes / 1e9:,.3g} GB",
                    (contexts[0], kv_memory_bytes / 1e9), va="bottom")
    elif weight_bytes is not None and memory_bytes is not None and weight_bytes >= memory_bytes:
        ax.text(0.02, 0.95, f"weights ({weight_bytes / 1e9:,.3g} GB) do not fit in the memory for them "
                f"({memory_bytes / 1e9:,.3g} GB): no room for any KV cache", transform=ax.transAxes,
                color="red", va="top")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"KV cache for batch {batch} (GB, {kv_dtype})")
    ax.set_title(f"{spec.name}: {spec.num_layers} layers, {spec.num_attention_heads} query heads, "
                 f"KV in {kv_dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
