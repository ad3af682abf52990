"""Roofline and KV-capacity arithmetic: pure functions of a model's shape and a machine's numbers.

Nothing here touches a tensor, so every number can be checked by hand. Units are plain: bytes, FLOPs,
seconds, tokens. Decimal prefixes (GB = 1e9 bytes) throughout, as in datasheets.

The model of decode used here is the usual one: each step reads every weight once (shared by the whole
batch) plus each sequence's cached K and V, and does 2 FLOPs per weight per token plus the attention
dot products. Activations, kernel launch costs and caches are ignored, so the results are upper bounds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.config import kv_elements_per_token_per_layer, sliding_window_layers
from pagedllm.spec_decode.adaptive import speculative_tokens_per_pass  # noqa: F401  (the planner's API too)

# Bytes per element for the dtypes people pass as --dtype / --kv-cache-dtype.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name (torch, vLLM or short spelling)."""
    key = dtype.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass
class ModelSpec:
    """The shape of a decoder-only transformer, as far as memory and FLOPs are concerned.

    Dense Llama/Qwen-style models need only the first block of fields. MLA (DeepSeek-V2/V3) sets
    kv_lora_rank and qk_rope_head_dim: its cache holds one compressed latent plus one shared RoPE key per
    token per layer instead of K and V per head. MoE sets the expert fields.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    # MLA (DeepSeek): q_lora_rank None means a plain q projection
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    # MoE: layers from first_k_dense_replace on (every moe_layer_freq-th) use experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # Sliding-window attention: num_sliding_layers of the layers attend over the last sliding_window tokens
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    # Filled from the shape unless given (e.g. a published count that includes extra heads).
    num_params: int | None = None
    num_active_params: int | None = None
    # A GGUF file's weights in its own block types, which the engine keeps packed: (bytes held, bytes a
    # decode step reads); None for a checkpoint in one float dtype.
    stored_weight_bytes: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_params is None:
            self.num_params = _count_params(self, active_only=False)
        if self.num_active_params is None:
            self.num_active_params = _count_params(self, active_only=True)

    # --- what kind of attention -------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return f"GQA-{self.num_kv_heads}"

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return sum(1 for i in range(self.first_k_dense_replace, self.num_layers) if i % self.moe_layer_freq == 0)

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: str | Path | dict[str, Any], name: str | None = None) -> ModelSpec:
        """Read a Hugging Face config.json (a path to the file or its directory, or the parsed dict)."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            name = name or path.parent.name
            config = json.loads(path.read_text())
        cfg = config.get("text_config", config)  # multimodal wrappers keep the LM under text_config
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        model_type = str(cfg.get("model_type", ""))
        kv_lora_rank = cfg.get("kv_lora_rank")
        window, layer_types = sliding_window_layers(cfg)
        return cls(
            name=name or str(cfg.get("_name_or_path") or model_type or "model"),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype.removeprefix("torch."),
            # Qwen2 has q/k/v biases without saying so in its config
            attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            kv_lora_rank=int(kv_lora_rank) if kv_lora_rank else None,
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
            q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
            num_experts=int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
            sliding_window=window,
            num_sliding_layers=sum(t == "sliding_attention" for t in layer_types or ()),
        )


# --- parameter counting --------------------------------------------------------------------------


def _attention_params(spec: ModelSpec) -> int:
    h, heads = spec.hidden_size, spec.num_attention_heads
    if spec.is_mla:
        assert spec.kv_lora_rank is not None
        qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        v_head = spec.v_head_dim or spec.head_dim
        if spec.q_lora_rank:
            q = h * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * heads * qk_head
        else:
            q = h * heads * qk_head
        kv_a = h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + spec.kv_lora_rank  # + its norm
        kv_b = spec.kv_lora_rank * heads * (spec.qk_nope_head_dim + v_head)
        return q + kv_a + kv_b + heads * v_head * h
    q_out = heads * spec.head_dim
    kv_out = spec.num_kv_heads * spec.head_dim
    params = h * q_out + 2 * h * kv_out + q_out * h
    if spec.attention_bias:
        params += q_out + 2 * kv_out
    return params


def _count_params(spec: ModelSpec, active_only: bool) -> int:
    """Parameters from the shape; active_only counts only the experts one token is routed to."""
    h = spec.hidden_size
    gated_mlp = lambda inter: 3 * h * inter  # gate, up, down
    per_layer = _attention_params(spec) + 2 * h  # two RMSNorms
    total = spec.num_layers * per_layer
    moe_layers = spec.num_moe_layers
    total += (spec.num_layers - moe_layers) * gated_mlp(spec.intermediate_size)
    if moe_layers:
        routed = spec.num_experts_per_tok if active_only else spec.num_experts
        experts = (routed + spec.num_shared_experts) * gated_mlp(spec.moe_intermediate_size)
        total += moe_layers * (experts + h * spec.num_experts)  # + router
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return total + embeddings + h  # + final norm


def decode_weight_params(spec: ModelSpec, batch: int = 1) -> float:
    """Parameters a decode step multiplies (and so reads): all of them, except that an untied input
    embedding only contributes `batch` rows, and an MoE step touches only the experts some token picked.

    With B tokens each picking k of E experts at random, the expected number of distinct experts per
    MoE layer is E * (1 - (1 - k/E)^B).
    """
    assert spec.num_params is not None and spec.num_active_params is not None
    params = float(spec.num_params)
    if not spec.tie_word_embeddings:
        params -= spec.vocab_size * spec.hidden_size  # the lookup reads one row per token
    if spec.is_moe:
        expert = 3 * spec.hidden_size * spec.moe_intermediate_size
        touched = spec.num_experts * (1 - (1 - spec.num_experts_per_tok / spec.num_experts) ** batch)
        params -= spec.num_moe_layers * (spec.num_experts - touched) * expert
    return params


def weight_bytes(spec: ModelSpec, weight_dtype_bytes: float | None = None) -> float:
    """Bytes to hold every weight (all experts)."""
    assert spec.num_params is not None
    return spec.num_params * (weight_dtype_bytes if weight_dtype_bytes is not None else dtype_bytes(spec.dtype))


def linear_weight_params(spec: ModelSpec) -> tuple[int, int]:
    """(weights, output channels) of the decoder layers' linear projections (q, k, v, o, gate, up,
    down): what weight-only quantization replaces. Embeddings, the LM head, norms and biases are not."""
    if spec.is_mla or spec.is_moe:
        raise ValueError("weight-only quantization sizes are planned for dense (non-MLA, non-MoE) models only")
    h, q_out, kv_out = spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = 2 * h * q_out + 2 * h * kv_out + 3 * h * spec.intermediate_size
    rows = q_out + 2 * kv_out + h + 2 * spec.intermediate_size + h
    return spec.num_layers * per_layer, spec.num_layers * rows


def quantized_weight_dtype_bytes(
    spec: ModelSpec, weight_dtype_bytes: float, quantization: str, group_size: int | None = None, decode: bool = True
) -> float:
    """Average bytes per weight when the linear projections are weight-only quantized (1 byte each, plus
    one scale per output channel, or per group of group_size weights: in the model dtype for int8, fp32
    for fp8; int4: half a byte each and a bf16 scale and zero per group, 128 unless given) and everything
    else stays at weight_dtype_bytes. A drop-in weight_dtype_bytes for the functions here: decode=True
    averages over the weights a decode step reads, False over all of them."""
    if quantization not in ("int8", "fp8", "int4"):
        raise ValueError(f"quantization must be 'int8', 'fp8' or 'int4', got {quantization!r}")
    linear, rows = linear_weight_params(spec)
    if quantization == "int4":
        group_size = group_size or 128
    scale_bytes = {"int8": weight_dtype_bytes, "fp8": 4, "int4": 4}[quantization]
    scales = (linear / group_size if group_size else rows) * scale_bytes
    assert spec.num_params is not None
    total = decode_weight_params(spec, 1) if decode else spec.num_params
    per_weight = 0.5 if quantization == "int4" else 1
    return (linear * per_weight + scales + (total - linear) * weight_dtype_bytes) / total


# --- KV cache ----------------------------------------------------------------------------------


def kv_bytes_per_token(spec: ModelSpec, kv_dtype_bytes: float) -> float:
    """Bytes of KV cache one token occupies across all layers (whole model, before any TP split).

    MHA/GQA/MQA: K and V, each num_kv_heads x head_dim, per layer. MLA: one latent of kv_lora_rank plus
    the shared RoPE key of qk_rope_head_dim per layer (what vLLM caches for DeepSeek).
    """
    per_layer = kv_elements_per_token_per_layer(spec.num_kv_heads, spec.head_dim, spec.kv_lora_rank,
                                                spec.qk_rope_head_dim)  # the engine's own formula
    return spec.num_layers * per_layer * kv_dtype_bytes


# kv_cache_dtype names the engine stores in one byte with a bf16 scale per row (kv_cache/quant.py)
ONE_BYTE_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2", "int8")
KV_SCALE_BYTES = 2


def kv_cache_element_bytes(spec: ModelSpec, kv_dtype: str) -> float:
    """Bytes per cached element as the engine stores `kv_dtype`: one-byte kinds add a 2-byte scale per
    row (one token's K or V of one head; MLA: its latent), so 1 + 2 / row. A drop-in kv_dtype_bytes
    for the functions here, so the planner's pool matches the engine's block for block."""
    element = dtype_bytes(kv_dtype)
    if kv_dtype not in ONE_BYTE_KV_DTYPES:
        return element
    row = (spec.kv_lora_rank or 0) + spec.qk_rope_head_dim if spec.is_mla else spec.head_dim
    return element + KV_SCALE_BYTES / row


def kv_scale_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> int:
    """Bytes of scales one token adds to a one-byte cache (whole model), as the engine stores them: a bf16
    scale per row (one token's K or V of one head; MLA: its latent), whether the scale is the row's own or
    a layer's (calculate_kv_scales, checkpoint k_scale/v_scale). 0 for other dtypes. vLLM keeps fp8 KV
    with per-tensor scales, which cost nothing per token: its figure is the elements alone,
    kv_bytes_per_token(spec, dtype_bytes(kv_dtype))."""
    if kv_dtype not in ONE_BYTE_KV_DTYPES:
        return 0
    rows_per_layer = 1 if spec.is_mla else 2 * spec.num_kv_heads
    return spec.num_layers * rows_per_layer * KV_SCALE_BYTES


def kv_bytes_per_token_per_device(spec: ModelSpec, kv_dtype_bytes: float, tp: int) -> float:
    """Tensor parallelism splits KV heads across devices; with fewer KV heads than devices each device
    keeps a replica of one head, and MLA's latent is not split by head at all, so it is replicated."""
    if spec.is_mla:
        return kv_bytes_per_token(spec, kv_dtype_bytes)
    heads_per_device = max(1, math.ceil(spec.num_kv_heads / tp))
    return 2 * spec.num_layers * heads_per_device * spec.head_dim * kv_dtype_bytes


def kv_cache_bytes(spec: ModelSpec, kv_dtype_bytes: float, context_len: int, batch: int) -> float:
    return kv_bytes_per_token(spec, kv_dtype_bytes) * context_len * batch


# --- FLOPs and the roofline ----------------------------------------------------------------------


def ridge_point(peak_flops: float, memory_bandwidth: float) -> float:
    """FLOPs per byte at which a kernel stops being memory-bound: peak / bandwidth."""
    return peak_flops / memory_bandwidth


def attention_flops_per_token(spec: ModelSpec, context_len: int) -> float:
    """FLOPs of Q.K^T and P.V for one new token against context_len cached tokens, all layers.
    MLA is counted in its absorbed form (queries attend to the latent directly), as decode runs it."""
    heads = spec.num_attention_heads
    if spec.is_mla:
        assert spec.kv_lora_rank is not None
        per_pos = heads * (2 * (spec.kv_lora_rank + spec.qk_rope_head_dim) + 2 * spec.kv_lora_rank)
    else:
        per_pos = heads * 4 * spec.head_dim
    return spec.num_layers * per_pos * context_len


def decode_bytes_per_step(
    spec: ModelSpec, context_len: int, batch: int, weight_dtype_bytes: float, kv_dtype_bytes: float
) -> float:
    """Bytes one decode step reads: the weights once, plus every sequence's cached KV."""
    weights = decode_weight_params(spec, batch) * weight_dtype_bytes
    return weights + kv_cache_bytes(spec, kv_dtype_bytes, context_len, batch)


def decode_bytes_per_token(
    spec: ModelSpec,
    context_len: int,
    batch: int = 1,
    weight_dtype_bytes: float | None = None,
    kv_dtype_bytes: float | None = None,
) -> float:
    """Bytes read per generated token at this batch size and context (the roofline's denominator).
    Dtype sizes default to the model's own dtype."""
    wb = weight_dtype_bytes if weight_dtype_bytes is not None else dtype_bytes(spec.dtype)
    kb = kv_dtype_bytes if kv_dtype_bytes is not None else wb
    return decode_bytes_per_step(spec, context_len, batch, wb, kb) / batch


def decode_flops_per_step(spec: ModelSpec, context_len: int, batch: int) -> float:
    # each token multiplies only its own experts, hence the batch-1 parameter count
    return batch * (2 * decode_weight_params(spec, 1) + attention_flops_per_token(spec, context_len))


def decode_intensity(
    spec: ModelSpec, batch: int, weight_dtype_bytes: float, context_len: int = 0, kv_dtype_bytes: float = 0.0
) -> float:
    """FLOPs per byte of a decode step. With context_len 0 it is the weights-only figure of the classic
    argument (2 FLOPs per weight per token over the weight's bytes: batch 1 in fp16 gives 1)."""
    flops = decode_flops_per_step(spec, context_len, batch)
    return flops / decode_bytes_per_step(spec, context_len, batch, weight_dtype_bytes, kv_dtype_bytes)


def compute_bound_batch(
    spec: ModelSpec,
    ridge: float,
    weight_dtype_bytes: float,
    context_len: int = 0,
    kv_dtype_bytes: float = 0.0,
    max_batch: int = 2**24,
) -> int | None:
    """Smallest batch whose decode intensity reaches the ridge point; None if none up to max_batch does.

    Weights-only that is ridge * w / 2 rounded up. With KV, intensity tends to the attention's own as the
    batch grows, which for GQA at long contexts sits below the ridge: such decode stays memory-bound at
    any batch. MoE's intensity grows slowly because a larger batch touches more experts. Intensity rises
    with batch in all these cases, so doubling then bisection finds the crossing.
    """

    def reached(batch: int) -> bool:
        return decode_intensity(spec, batch, weight_dtype_bytes, context_len, kv_dtype_bytes) >= ridge

    high = 1
    while not reached(high):
        if high >= max_batch:
            return None
        high *= 2
    low = high // 2  # not reached (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if reached(mid) else (mid, high)
    return high


@dataclass
class DecodeBound:
    tokens_per_s: float  # the bound: min of the memory and compute limits
    memory_bound_tokens_per_s: float
    compute_bound_tokens_per_s: float
    step_time_s: float
    bytes_per_step: float
    flops_per_step: float
    limited_by: str  # "memory" or "compute"


def decode_bound(
    spec: ModelSpec,
    context_len: int,
    batch: int,
    weight_dtype_bytes: float,
    kv_dtype_bytes: float,
    peak_flops: float,
    memory_bandwidth: float,
    tp: int = 1,
) -> DecodeBound:
    """Upper bound on decode throughput (tokens/s summed over the batch). TP divides bytes and FLOPs
    over tp devices and ignores the all-reduces. An infinite peak_flops (unknown: the latency benchmark on
    a GPU) leaves the memory bound alone."""
    nbytes = decode_bytes_per_step(spec, context_len, batch, weight_dtype_bytes, kv_dtype_bytes)
    flops = decode_flops_per_step(spec, context_len, batch)
    t_mem = nbytes / (memory_bandwidth * tp)
    t_compute = flops / (peak_flops * tp)
    step = max(t_mem, t_compute)
    return DecodeBound(
        tokens_per_s=batch / step,
        memory_bound_tokens_per_s=batch / t_mem,
        compute_bound_tokens_per_s=batch / t_compute if t_compute else math.inf,
        step_time_s=step,
        bytes_per_step=nbytes,
        flops_per_step=flops,
        limited_by="memory" if t_mem >= t_compute else "compute",
    )


def prefill_flops(spec: ModelSpec, prompt_len: int) -> float:
    """FLOPs to prefill one prompt: 2 per (active) weight per token plus causal attention, where token i
    attends to i earlier tokens (prompt_len^2 / 2 pairs)."""
    assert spec.num_active_params is not None
    linear = 2 * (spec.num_active_params - spec.vocab_size * spec.hidden_size * (0 if spec.tie_word_embeddings else 1))
    return prompt_len * linear + attention_flops_per_token(spec, 1) * prompt_len * prompt_len / 2


def prefill_bound_tokens_per_s(spec: ModelSpec, prompt_len: int, peak_flops: float, tp: int = 1) -> float:
    """Prompt tokens per second if prefill ran at peak FLOP/s (it is compute-bound at any useful length)."""
    return prompt_len * peak_flops * tp / prefill_flops(spec, prompt_len)


# --- tensor-parallel communication ---------------------------------------------------------------


def all_reduce_bytes_per_token(spec: ModelSpec, tp: int, activation_bytes: float) -> float:
    """Bytes all-reduced per token under Megatron sharding: one hidden-size vector after o_proj and one
    after down_proj in every layer, plus one after the vocab-parallel embedding. 0 at tp 1. (A ring
    all-reduce moves 2 (tp - 1) / tp of this over each rank's link.)"""
    if tp <= 1:
        return 0.0
    return (2 * spec.num_layers + 1) * spec.hidden_size * activation_bytes


def logits_gather_bytes_per_token(spec: ModelSpec, tp: int, activation_bytes: float) -> float:
    """Bytes of logits gathered on rank 0 per sampled token (each rank sends its vocab/tp share)."""
    if tp <= 1:
        return 0.0
    return spec.vocab_size * activation_bytes


# --- capacity ------------------------------------------------------------------------------------


@dataclass
class Capacity:
    """What fits in the memory left for KV after the weights (per device; activations not counted)."""

    usable_bytes_per_device: float
    weight_bytes_per_device: float
    kv_memory_bytes_per_device: float
    kv_bytes_per_token_per_device: float
    max_kv_tokens: int
    num_blocks: int
    blocks_per_sequence: int
    max_sequences: int  # at full context
    block_waste_tokens: int  # per request at this context: at most block_size - 1
    block_waste_bytes: float  # per request, whole model
    fits: bool = field(default=True)


def sliding_window_kv(spec: ModelSpec, context_len: int, block_size: int) -> dict[str, Any] | None:
    """What a sequence of context_len tokens holds with the window counted, as fractions of the same model
    with windows ignored. A sliding layer needs only the blocks its window sees (ceil(window / block_size)
    + 1); `fraction_per_layer_kv` is that over all layers (full layers hold everything). `fraction_engine`
    is what pagedllm's KV cache manager holds: the same, since full and sliding layers keep separate KV
    cache groups of equal size in one pool (kv_cache/manager.py); `fraction_engine_without_groups` is what
    it holds where groups are off (speculative decoding, a KV connector or a one-byte KV cache keep every
    block of a model with full layers)."""
    if spec.sliding_window is None or spec.num_sliding_layers == 0:
        return None
    full_blocks = max(1, math.ceil(context_len / block_size))
    window_blocks = min(full_blocks, math.ceil(spec.sliding_window / block_size) + 1)
    num_full = spec.num_layers - spec.num_sliding_layers
    per_layer = (num_full * full_blocks + spec.num_sliding_layers * window_blocks) / (spec.num_layers * full_blocks)
    return {
        "window": spec.sliding_window,
        "num_sliding_layers": spec.num_sliding_layers,
        "blocks_per_sequence_in_window": window_blocks,
        "fraction_per_layer_kv": per_layer,
        # (config.kv_cache_groups: groups of gcd(full, sliding) layers; one group when every layer slides)
        "num_kv_cache_groups": spec.num_layers // math.gcd(num_full, spec.num_sliding_layers) if num_full else 1,
        "fraction_engine": per_layer,
        "fraction_engine_without_groups": window_blocks / full_blocks if num_full == 0 else 1.0,
    }


def capacity(
    spec: ModelSpec,
    memory_bytes_per_device: float,
    gpu_memory_utilization: float,
    tp: int,
    weight_dtype_bytes: float,
    kv_dtype_bytes: float,
    block_size: int,
    context_len: int,
) -> Capacity:
    usable = memory_bytes_per_device * gpu_memory_utilization
    weights = weight_bytes(spec, weight_dtype_bytes) / tp
    kv_memory = max(0.0, usable - weights)
    per_token = kv_bytes_per_token_per_device(spec, kv_dtype_bytes, tp)
    num_blocks = int(kv_memory // (per_token * block_size))
    blocks_per_seq = max(1, math.ceil(context_len / block_size))
    waste = blocks_per_seq * block_size - context_len if context_len > 0 else 0
    return Capacity(
        usable_bytes_per_device=usable,
        weight_bytes_per_device=weights,
        kv_memory_bytes_per_device=kv_memory,
        kv_bytes_per_token_per_device=per_token,
        max_kv_tokens=num_blocks * block_size,
        num_blocks=num_blocks,
        blocks_per_sequence=blocks_per_seq,
        max_sequences=num_blocks // blocks_per_seq,
        block_waste_tokens=waste,
        block_waste_bytes=waste * kv_bytes_per_token(spec, kv_dtype_bytes),
        fits=usable > weights,
    )




def kv_variants(spec: ModelSpec) -> dict[str, ModelSpec]:
    """The same model with each attention variant, for comparing KV sizes: MHA (one KV head per query
    head), the model's own grouping, MQA (one KV head), and MLA with DeepSeek's 512 + 64 latent.
    For an MLA model the MHA form caches K of qk_nope + qk_rope and V of v_head per head, so head_dim
    is set to their mean to keep 2 x head_dim equal to K + V."""
    import dataclasses

    dense = spec
    if spec.is_mla:
        head_dim = (spec.qk_nope_head_dim + spec.qk_rope_head_dim + (spec.v_head_dim or spec.head_dim)) / 2
        dense = dataclasses.replace(
            spec,
            kv_lora_rank=None,
            head_dim=head_dim,  # type: ignore[arg-type]
            num_kv_heads=spec.num_attention_heads,
            num_params=spec.num_params,
            num_active_params=spec.num_active_params,
        )
    keep = dict(num_params=spec.num_params, num_active_params=spec.num_active_params)
    variants = {"MHA": dataclasses.replace(dense, num_kv_heads=dense.num_attention_heads, **keep)}
    if not spec.is_mla and spec.attention_kind not in ("MHA", "MQA"):
        variants[spec.attention_kind] = spec
    variants["MQA"] = dataclasses.replace(dense, num_kv_heads=1, **keep)
    variants["MLA"] = spec if spec.is_mla else dataclasses.replace(spec, kv_lora_rank=512, qk_rope_head_dim=64, **keep)
    return variants


@dataclass
class Disaggregation:
    """One long prompt arriving while `batch` sequences decode: colocated on one machine with chunked
    prefill, or prefilled on a second machine and its KV shipped over a link of `link_bandwidth`."""

    prompt_len: int
    kv_bytes: float              # the prompt's KV, what crosses the link
    transfer_s: float            # kv_bytes / link bandwidth
    prefill_s: float             # the prompt at peak FLOP/s
    decode_step_s: float         # one decode step of the batch (its memory-bound time)
    colocated_itl_s: float       # a decode step that also carries a prefill chunk
    colocated_stalled_steps: int  # steps of the running decodes slowed by the prompt
    colocated_ttft_s: float
    disaggregated_itl_s: float   # decode steps never carry a prefill; the KV copy-in uses memory bandwidth
    disaggregated_ttft_s: float


def disaggregation(spec: ModelSpec, prompt_len: int, context_len: int, batch: int, weight_dtype_bytes: float,
                   kv_dtype_bytes: float, peak_flops: float, memory_bandwidth: float, link_bandwidth: float,
                   chunk_tokens: int = 2048, tp: int = 1) -> Disaggregation:
    """The usual first-order picture (DistServe, Splitwise): colocated, every step that carries a chunk of
    the prompt takes the chunk's compute time on top of the decode step, for ceil(prompt / chunk) steps;
    disaggregated, decode steps stay at their own time and the prompt's first token waits for the prefill
    plus the transfer plus one decode step. Upper-bound arithmetic like the rest of this module."""
    kv_bytes = kv_bytes_per_token(spec, kv_dtype_bytes) * prompt_len
    prefill_s = prefill_flops(spec, prompt_len) / (peak_flops * tp)
    step = decode_bound(spec, context_len, batch, weight_dtype_bytes, kv_dtype_bytes, peak_flops, memory_bandwidth,
                        tp).step_time_s
    num_chunks = math.ceil(prompt_len / chunk_tokens)
    chunk_s = prefill_s / num_chunks
    transfer_s = kv_bytes / link_bandwidth
    copy_in_s = kv_bytes / (memory_bandwidth * tp)  # the decode machine writes the blocks into its pool
    return Disaggregation(
        prompt_len=prompt_len, kv_bytes=kv_bytes, transfer_s=transfer_s, prefill_s=prefill_s, decode_step_s=step,
        colocated_itl_s=step + chunk_s, colocated_stalled_steps=num_chunks,
        colocated_ttft_s=prefill_s + num_chunks * step,
        disaggregated_itl_s=step + copy_in_s / max(1, num_chunks),
        disaggregated_ttft_s=prefill_s + transfer_s + step)
