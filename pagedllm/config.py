"""Configuration: what the model is (ModelConfig, read from a Hugging Face config.json) and how the
engine runs it (CacheConfig, SchedulerConfig, DeviceConfig)."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.kv_cache import quant as kv_quant
from pagedllm.platform import cpu_has_native

if TYPE_CHECKING:
    from pagedllm.layers.quantization import QuantizationConfig

logger = logging.getLogger(__name__)

_STR_TO_DTYPE = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: str | torch.dtype, config_dtype: str | None,
                  device: torch.device | None = None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        dtype = _STR_TO_DTYPE.get(str(config_dtype), torch.float32) if config_dtype else torch.float32
        if device is not None and device.type == "cpu" and not cpu_has_native(dtype):
            # The checkpoint's half precision would be emulated here, several times slower than fp32.
            logger.info("dtype=auto: this CPU has no native %s matmul; running in float32 "
                        "(pass dtype=%r to force it)", dtype, str(dtype).removeprefix("torch."))
            return torch.float32
        return dtype
    if name not in _STR_TO_DTYPE:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {name!r}.")
    return _STR_TO_DTYPE[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}.") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available.")
    return device


@dataclass
class RopeConfig:
    theta: float = 10000.0
    scaling: dict[str, Any] | None = None  # rope_type plus its parameters; None for plain RoPE

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        # transformers 5 writes `rope_parameters` (theta inside); published checkpoints mostly use the
        # top-level `rope_theta` and `rope_scaling`. Read both.
        params = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = dict(legacy) if legacy else params
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type == "su":  # Phi-3's first name for LongRoPE
            rope_type = "longrope"
        if rope_type == "default":
            return cls(theta=theta, scaling=None)
        scaling["rope_type"] = rope_type
        if rope_type == "dynamic":  # (transformers scales from max_position_embeddings)
            scaling["original_max_position_embeddings"] = hf.get("max_position_embeddings", 2048)
        if rope_type in ("llama3", "yarn", "longrope"):
            # As transformers: a top-level original_max_position_embeddings wins, else max_position_embeddings.
            if hf.get("original_max_position_embeddings"):
                scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
        if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
            scaling["factor"] = hf.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
        return cls(theta=theta, scaling=scaling)


@dataclass
class ModelConfig:
    """The parts of a Hugging Face config.json the engine needs, with defaults filled in."""

    model: str
    architecture: str
    hf_config: dict[str, Any]
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig
    hidden_act: str = "silu"
    # Biases beyond q|k|v's: on o_proj (Llama's and Qwen3's attention_bias covers all four projections,
    # Qwen2's implicit bias only q|k|v) and on the MLP's projections (Llama's mlp_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    # MLA (DeepSeek-V2/V3): each layer caches one latent of kv_lora_rank plus a rope key of qk_rope_head_dim
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention: layer i attends over the last `sliding_window` positions when
    # layer_types[i] == "sliding_attention" (Hugging Face's names); None / "full_attention" otherwise.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    bos_token_id: int | None = None
    # Weight-only quantization of the linear projections (None: weights stay in `dtype`).
    quantization: QuantizationConfig | None = None
    # the generation_config.json that default sampling comes from ({} for generation_config="vllm")
    generation_config: dict[str, Any] = field(default_factory=dict)
    # Multi-LoRA serving (a pagedllm.lora.config.LoRAConfig; None: adapters off): the model runner of
    # each rank wraps its projections for it
    lora_config: Any = None

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """SamplingParams fields the model's generation config sets, as vLLM's `--generation-config auto`
        reads them: max_new_tokens becomes max_tokens; do_sample false (greedy) becomes temperature 0."""
        config = self.generation_config
        diff = {ours: config[theirs] for theirs, ours in _GENERATION_CONFIG_FIELDS.items()
                if config.get(theirs) is not None}
        if config.get("do_sample") is False:
            diff["temperature"] = 0.0
        return diff

    @classmethod
    def from_pretrained(cls, model: str, dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                        device: torch.device | None = None, quantization: str | None = None,
                        quantization_group_size: int | None = None, trust_remote_code: bool = False,
                        generation_config: str = "auto", hf_overrides: dict[str, Any] | None = None,
                        override_generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """`hf_overrides` (vLLM's): keys of the model's config.json replaced (nested dicts merged);
        `override_generation_config` (vLLM's): sampling defaults over those the generation config gives."""
        from pagedllm.layers.quantization import resolve_quantization
        from pagedllm.models.gguf import read_hf_config, resolve_gguf_file
        from pagedllm.models.registry import resolve_architecture, supported_architectures

        gguf_file = resolve_gguf_file(model)
        if gguf_file is not None:
            # a GGUF file carries no sampling defaults: a generation_config.json beside it gives them
            generation = _read_json(os.path.join(os.path.dirname(os.path.abspath(gguf_file)),
                                                 "generation_config.json"))
            model, hf = gguf_file, read_hf_config(gguf_file)
        else:
            check_model_path(model)
            config_path = os.path.join(model, "config.json")
            with open(config_path) as f:
                hf = json.load(f)
            generation = _read_json(os.path.join(model, "generation_config.json"))
        hf = _merged(hf, hf_overrides or {})
        architectures = hf.get("architectures") or []
        if hf.get("auto_map") and not any(name in supported_architectures() for name in architectures):
            # the architecture exists only as Python code shipped with the checkpoint
            raise ValueError(f"model {model!r} needs custom code (auto_map in config.json) for {architectures}; "
                             "pagedllm runs only its own model implementations (trust_remote_code="
                             f"{trust_remote_code} lets a custom tokenizer load, never a custom model). "
                             f"Supported architectures: {', '.join(supported_architectures())}.")
        architecture = resolve_architecture(architectures)
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hidden // heads
        max_pos = int(hf.get("max_position_embeddings", 2048))
        sliding_window, layer_types = sliding_window_layers(hf)
        if max_model_len is None:
            max_model_len = max_pos
        elif max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}.")
        elif max_model_len > max_pos:
            logger.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d",
                           max_model_len, max_pos)
        model_type = hf.get("model_type", "")
        qkv_bias = bool(hf.get("attention_bias", False)) or model_type == "qwen2"
        o_bias = bool(hf.get("attention_bias", False)) and model_type not in ("qwen2", "phi3")
        sampling_defaults = {**_sampling_generation_config(model, generation, generation_config),
                             **(override_generation_config or {})}
        eos = generation.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            model=model,
            architecture=architecture,
            hf_config=hf,
            dtype=resolve_dtype(dtype, hf.get("dtype") or hf.get("torch_dtype"), device),
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            max_model_len=max_model_len,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope=RopeConfig.from_hf(hf),
            # Gemma names it hidden_activation (and may carry a stale hidden_act beside it).
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            kv_lora_rank=int(hf["kv_lora_rank"]) if hf.get("kv_lora_rank") else None,
            qk_rope_head_dim=int(hf.get("qk_rope_head_dim") or 0),
            eos_token_ids=eos_ids,
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
            generation_config=sampling_defaults,
            quantization=resolve_quantization(quantization, quantization_group_size, hf),
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of decoder layer `layer` (None: full attention)."""
        if self.sliding_window is None or self.layer_types is None:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer slides over the same one (a request's blocks before it can be
        freed), else None."""
        if self.sliding_window is None or self.layer_types is None:
            return None
        return self.sliding_window if all(t == "sliding_attention" for t in self.layer_types) else None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def get_num_kv_heads(self, tp_size: int = 1) -> int:
        """KV heads one rank holds: a share of them, or one (replicated) when there are fewer than ranks."""
        return max(1, self.num_key_value_heads // tp_size)

    def kv_cache_layer_shape(self, num_blocks: int, block_size: int, tp_size: int = 1,
                             kv_dtype: torch.dtype | None = None) -> tuple[int, ...]:
        """One rank's cache tensor for one layer: [2 (K, V), kv_heads, blocks, block_size, head_dim], or for
        MLA [1, 1, blocks, block_size, kv_lora_rank + qk_rope_head_dim] (one latent + rope key per token;
        the same block axis, so block copies and the pool treat both alike). A one-byte kv_dtype stores
        uint8 [P, H, blocks, block_size * (row + 2)]: each tile's codes, then a bf16 scale per row
        (kv_cache/quant.py)."""
        if self.is_mla:
            shape = (1, 1, num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)
        else:
            shape = (2, self.get_num_kv_heads(tp_size), num_blocks, block_size, self.head_dim)
        if kv_dtype is not None and kv_quant.is_quantized(kv_dtype):
            return kv_quant.quantized_layer_shape(shape)
        return shape

    def kv_bytes_per_token(self, kv_dtype: torch.dtype, tp_size: int = 1) -> int:
        """KV cache bytes per token on one rank, one-byte kinds' scales included."""
        if self.is_mla:
            rows, row = 1, self.kv_lora_rank + self.qk_rope_head_dim
        else:
            rows, row = 2 * self.get_num_kv_heads(tp_size), self.head_dim
        return self.num_hidden_layers * rows * kv_quant.bytes_per_row(row, kv_dtype)


# model_type -> how its Hugging Face implementation decides which layers slide: "all" (every layer, when
# sliding_window is set), "max_window_layers" (Qwen: with use_sliding_window, layers from
# max_window_layers on), an int n (Gemma: every layer but each n-th, from `sliding_window_pattern`
# where given). A config's own `layer_types` wins where the implementation reads it. Llama and DeepSeek
# have no sliding layers whatever the config says.
_SLIDING_LAYOUT: dict[str, str | int] = {
    "mistral": "all", "mixtral": "all", "phi3": "all", "qwen3_moe": "all",
    "qwen2": "max_window_layers", "qwen3": "max_window_layers",
    "gemma2": 2, "gemma3_text": 6,
}
_READS_LAYER_TYPES = ("qwen2", "qwen3", "gemma2", "gemma3_text")


def sliding_window_layers(hf: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as the model's reference implementation applies them."""
    model_type = hf.get("model_type", "")
    layout = _SLIDING_LAYOUT.get(model_type)
    window = hf.get("sliding_window")
    if layout is None or not window:
        return None, None
    if model_type.startswith("qwen") and not hf.get("use_sliding_window"):
        return None, None
    window = int(window)
    if window <= 0:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}.")
    num_layers = int(hf["num_hidden_layers"])
    if hf.get("layer_types") and model_type in _READS_LAYER_TYPES:
        layer_types = list(hf["layer_types"])
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers.")
    elif layout == "all":
        layer_types = ["sliding_attention"] * num_layers
    elif layout == "max_window_layers":
        first = int(hf.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    else:
        pattern = int(hf.get("sliding_window_pattern") or layout)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if "sliding_attention" not in layer_types:
        return None, None
    return window, layer_types


def kv_cache_groups(sliding_window: int | None, layer_types: list[str] | None
                    ) -> list[tuple[int | None, list[int]]] | None:
    """The KV cache groups of a model that mixes full and sliding layers (see kv_cache/manager.py), as
    (window or None, layer indices): every group has g = gcd(full layers, sliding layers) layers, so a
    physical block holds one block of each of g layers for whichever group holds it, and nothing is
    padded. None when every layer is alike (one group of all layers)."""
    if sliding_window is None or layer_types is None:
        return None
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    full = [i for i, t in enumerate(layer_types) if t != "sliding_attention"]
    if not sliding or not full:
        return None
    size = math.gcd(len(full), len(sliding))
    return ([(None, full[i:i + size]) for i in range(0, len(full), size)]
            + [(sliding_window, sliding[i:i + size]) for i in range(0, len(sliding), size)])


def kv_elements_per_token_per_layer(num_kv_heads: int, head_dim: int, kv_lora_rank: int | None = None,
                                    qk_rope_head_dim: int = 0) -> int:
    """Cache elements one token takes in one layer; the one formula behind the engine's KV sizing, its
    start-up log and the planner. MHA/GQA/MQA: K and V per KV head. MLA: the compressed latent plus the
    shared rope key, not expanded K/V."""
    if kv_lora_rank is not None:
        return kv_lora_rank + qk_rope_head_dim
    return 2 * num_kv_heads * head_dim


# generation_config.json name -> SamplingParams field (the fields vLLM's --generation-config auto reads)
_GENERATION_CONFIG_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                             "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """base with overrides' keys replaced, nested dicts merged key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def _sampling_generation_config(model: str, generation: dict[str, Any], mode: str) -> dict[str, Any]:
    if mode == "vllm":
        return {}
    if mode == "auto":
        return generation
    path = os.path.join(mode, "generation_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory with a generation_config.json; "
                         f"{path!r} does not exist.")
    return _read_json(path)


def check_model_path(model: str) -> None:
    """ValueError unless `model` is a local model: a .gguf file, or a directory with a config.json or one
    .gguf file (checked before anything else reads the path, such as the tokenizer's loader)."""
    from pagedllm.models.gguf import resolve_gguf_file

    if resolve_gguf_file(model) is not None:
        return
    if not os.path.isdir(model):
        raise ValueError(_not_a_directory(model))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json (nor one .gguf file).")


def _not_a_directory(model: str) -> str:
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id:
        return (f"model {model!r} is not a local directory: pagedllm loads models only from local Hugging Face "
                "format directories and GGUF files, and downloads nothing; fetch it first (e.g. `hf download "
                f"{model} --local-dir DIR`) and pass DIR.")
    if os.path.exists(model):
        return (f"model must be a local Hugging Face model directory or a .gguf file; {model!r} is a file of "
                "another kind.")
    return f"model must be a local Hugging Face model directory or a .gguf file; {model!r} does not exist."


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    # KV cache groups (config.kv_cache_groups): (sliding window or None, layer indices) per group, all of
    # one size; None: one group of every layer. Decided at start-up (create_engine_config).
    kv_cache_groups: list[tuple[int | None, list[int]]] | None = None
    # One-byte caches: per-layer static scales from each layer's first batch instead of a scale per row
    calculate_kv_scales: bool = False
    enable_prefix_caching: bool = True
    # TORCH_SDPA, TORCH_FLASH, CPU_FLASH, TRITON; None: PAGEDLLM_ATTENTION_BACKEND, else the device's default
    attention_backend: str | None = None
    num_blocks: int = 0  # decided at start-up from the memory budget
    # Each KV cache group's window as the KV cache manager frees blocks out of it (None: full attention, or
    # every block kept); set by the engine core, read by admission (InputProcessor)
    group_windows: list[int | None] | None = None
    # Disaggregated prefill (a KVTransferConfig): kept with the cache's config because it is about the
    # cache's blocks, and so it reaches every worker the way the cache config does.
    kv_transfer_config: Any = None


@dataclass
class ParallelConfig:
    """How the model is split over processes: tensor parallelism, over one host or several (nnodes)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # "uni": in this process; "mp": one process per rank
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0, where the ranks meet (TCP rendezvous)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def verify_with_model_config(self, model: ModelConfig) -> None:
        """Every rank must hold whole heads and an equal slice of the MLP."""
        tp = self.tensor_parallel_size
        if tp > 1 and model.architecture in _NO_TENSOR_PARALLEL:
            raise ValueError(f"tensor_parallel_size={tp} is not supported for {model.architecture} yet (its MLA "
                             "attention and experts are not sharded); use tensor_parallel_size=1.")
        checks = [("num_attention_heads", model.num_attention_heads), ("intermediate_size", model.intermediate_size)]
        for name, value in checks:
            if value % tp:
                raise ValueError(f"{name} ({value}) of {model.model!r} must be divisible by "
                                 f"tensor_parallel_size ({tp}).")
        kv = model.num_key_value_heads
        if kv % tp and tp % kv:
            raise ValueError(f"num_key_value_heads ({kv}) of {model.model!r} and tensor_parallel_size ({tp}) must "
                             "divide one another (KV heads are split, or replicated when there are fewer than ranks).")
        group = model.quantization.group_size if model.quantization is not None else None
        if tp > 1 and group:
            # A row-parallel rank holds a range of input features; a group split between two ranks would
            # need its one scale on both (the loader checks every weight again, by name, as it shards).
            for param, size in (("self_attn.o_proj.weight", model.num_attention_heads * model.head_dim),
                                ("mlp.down_proj.weight", model.intermediate_size)):
                if (size // tp) % group:
                    raise ValueError(f"quantization_group_size ({group}) must divide the input features each rank "
                                     f"holds of {param} ({size} / tensor_parallel_size {tp} = {size // tp}), so "
                                     f"that no rank splits a quantization group.")


# Architectures whose layers (MLA, mixtures of experts) have no sharded form yet.
_NO_TENSOR_PARALLEL = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "lpm": longest cached prefix first
    num_speculative_tokens: int = 0
    # Slots kept past each request's scheduled tokens for a draft model's KV, which lives in the target's
    # blocks (vLLM's name): the positions of the tokens a step samples and of the drafts after them.
    num_lookahead_tokens: int = 0
    # Step N+1 is planned while step N runs (see EngineCore): requests advance num_computed_tokens when
    # scheduled, and the worker appends the tokens it samples to its own copy of each request.
    async_scheduling: bool = False
    # Most distinct LoRA adapters among the running requests (so in one step); 0: LoRA off
    max_loras: int = 0
