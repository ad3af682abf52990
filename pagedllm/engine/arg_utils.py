"""EngineArgs: every engine knob of `LLM(...)`, also as command-line flags with vLLM's spelling; and the
validated configs built from them (create_engine_config)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any

import torch

from pagedllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, kv_cache_groups, resolve_device
from pagedllm.kv_cache.quant import KV_CACHE_DTYPES, ONE_BYTE_DTYPES
from pagedllm.spec_decode import SpeculativeConfig

logger = logging.getLogger(__name__)


# vLLM's structured-output backends: any of them is taken, and llguidance serves the constraint
GUIDED_DECODING_BACKENDS = ("auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer")


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # auto: the model's dtype. fp8 (= fp8_e4m3), fp8_e5m2, int8: one byte per element plus a bf16 scale
    # per token and KV head (see pagedllm/kv_cache/quant.py)
    kv_cache_dtype: str = "auto"
    # One-byte caches only: one static scale per layer for K and V, computed from the first batch (vLLM's)
    calculate_kv_scales: bool = False
    # Every layer attends over the whole context and keeps all its KV, as if the model had no sliding
    # window (outputs change): to measure what the window saves in KV blocks and decode time.
    ignore_sliding_window: bool = False
    attention_backend: str | None = None
    seed: int = 0
    device: str = "auto"
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "uni" | "mp"; default: uni at TP 1, mp above
    nnodes: int = 1                    # hosts the tensor-parallel ranks are spread over
    node_rank: int = 0                 # this host's index; only node 0 schedules and serves
    dist_init_addr: str | None = None  # "HOST:PORT" of node 0, where all ranks meet (TCP rendezvous)
    # Plan step N+1 while the worker process runs step N (vLLM's --async-scheduling): the engine's own
    # work leaves the critical path. Runs the model in a worker process (distributed_executor_backend='mp').
    async_scheduling: bool = False
    enforce_eager: bool = True
    trust_remote_code: bool = False
    # Per-request bounds on the lists a client may send: every step checks each running request's
    # stop strings, so a 100,000-entry list would slow every other request down.
    max_stop_strings: int = 128
    max_stop_string_len: int = 1024
    max_stop_token_ids: int = 1024
    # torch intra-op threads for this process (None: OMP_NUM_THREADS, else torch's default)
    num_threads: int | None = None
    # "auto": defaults from the model's generation_config.json; "vllm": SamplingParams' own; or a
    # directory holding a generation_config.json
    generation_config: str = "auto"
    quantization: str | None = None
    quantization_group_size: int | None = None
    # Disaggregated prefill: a KVTransferConfig, its dict, or its JSON text (kv_role is required)
    kv_transfer_config: Any = None
    # Multi-LoRA serving (vLLM's names): PEFT adapters named per request by a LoRARequest
    enable_lora: bool = False
    max_loras: int = 1          # adapters on the device at once, and the most distinct ones in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in CPU memory (default: max_loras)
    # vLLM's arguments that ask nothing of this engine at their usual values, taken so a vLLM script runs
    # unchanged; any other value is a ValueError naming it (__post_init__)
    disable_log_stats: bool = True
    swap_space: float = 4        # GiB of CPU swap for preempted sequences: preemption here recomputes
    cpu_offload_gb: float = 0
    tokenizer_mode: str = "auto"
    load_format: str = "auto"
    task: str = "auto"
    pipeline_parallel_size: int = 1
    revision: str | None = None  # models are local paths: nothing is fetched at a revision
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    max_seq_len_to_capture: int = 8192  # CUDA-graph capture, which pagedllm does not do
    disable_custom_all_reduce: bool = False
    compilation_config: Any = None  # torch.compile levels: every model runs eagerly (None, 0 or {})
    enable_sleep_mode: bool = False
    disable_async_output_proc: bool = False
    logprobs_mode: str = "raw_logprobs"  # logprobs are the model's own, before penalties and biases
    guided_decoding_backend: str = "auto"  # llguidance serves every constraint
    limit_mm_per_prompt: dict[str, int] | None = None  # text-only models: nothing multimodal
    served_model_name: str | list[str] | None = None  # the server's flag; offline it names nothing
    # vLLM's, which change what runs: keys of the model's config.json replaced; sampling defaults over the
    # generation config's; no tokenizer (prompts are token ids, outputs have no text)
    hf_overrides: dict[str, Any] | None = None
    override_generation_config: dict[str, Any] | None = None
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        # vLLM's enforce_eager=False lets it capture CUDA graphs / torch.compile the model; pagedllm does
        # neither (compiling the decode path was measured slower on CPU), so it refuses to pretend.
        for name, allowed in (("tokenizer_mode", ("auto", "hf")), ("load_format", ("auto", "safetensors", "gguf")),
                              ("task", ("auto", "generate"))):
            check(getattr(self, name) in allowed, f"{name} must be one of {list(allowed)} here, "
                                                  f"got {getattr(self, name)!r}.")
        check(self.pipeline_parallel_size == 1,
              f"pipeline_parallel_size must be 1: pagedllm splits a model over tensor_parallel_size only, got "
              f"{self.pipeline_parallel_size}.")
        check(self.cpu_offload_gb == 0, f"cpu_offload_gb must be 0: weights stay where the model runs, got "
                                        f"{self.cpu_offload_gb}.")
        check(self.swap_space >= 0, f"swap_space must be non-negative, got {self.swap_space}.")
        check(self.compilation_config in (None, 0, {}),
              f"compilation_config must be None, 0 or {{}}: pagedllm runs every model eagerly, got "
              f"{self.compilation_config!r}.")
        check(not self.enable_sleep_mode, "enable_sleep_mode must be False: pagedllm has no sleep mode.")
        check(self.logprobs_mode == "raw_logprobs",
              f"logprobs_mode must be 'raw_logprobs' here (the model's own logprobs), got {self.logprobs_mode!r}.")
        check(self.guided_decoding_backend in GUIDED_DECODING_BACKENDS,
              f"guided_decoding_backend must be one of {list(GUIDED_DECODING_BACKENDS)} (llguidance serves them "
              f"all), got {self.guided_decoding_backend!r}.")
        check(not any((self.limit_mm_per_prompt or {}).values()),
              f"limit_mm_per_prompt must allow nothing: pagedllm serves text-only models, got "
              f"{self.limit_mm_per_prompt!r}.")
        for name in ("hf_overrides", "override_generation_config"):
            check(getattr(self, name) is None or isinstance(getattr(self, name), dict),
                  f"{name} must be a dict, got {type(getattr(self, name)).__name__}.")
        check(self.tokenizer is None or os.path.exists(os.path.expanduser(self.tokenizer)),
              f"tokenizer {self.tokenizer!r} does not exist: pass a local tokenizer directory or .gguf file "
              "(nothing is downloaded).")
        check(bool(self.enforce_eager),
              "enforce_eager=False asks for CUDA-graph capture or torch.compile, which pagedllm does not do: "
              "every model runs eagerly. Pass enforce_eager=True or leave it out.")
        check(isinstance(self.block_size, int) and self.block_size >= 1,
              f"block_size must be a positive integer, got {self.block_size}.")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
              f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
              f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}.")
        check(self.scheduling_policy in ("fcfs", "lpm"),
              f"scheduling_policy must be 'fcfs' or 'lpm', got {self.scheduling_policy!r}.")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size}.")
        check(isinstance(self.nnodes, int) and self.nnodes >= 1,
              f"nnodes must be a positive integer, got {self.nnodes}.")
        check(isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes,
              f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}.")
        check(self.tensor_parallel_size % self.nnodes == 0,
              f"tensor_parallel_size ({self.tensor_parallel_size}) must be divisible by nnodes ({self.nnodes}).")
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            check(bool(host) and port.isdigit(),
                  f"dist_init_addr must be HOST:PORT of node 0 when nnodes > 1, got {self.dist_init_addr!r}.")
        if self.async_scheduling:
            # The overlap needs the model in another process: in this one, the worker's Python and the
            # engine's would take turns on one interpreter lock.
            check(self.distributed_executor_backend in (None, "mp"),
                  "async_scheduling=True runs the model in a worker process while the engine plans the next "
                  "step; it needs distributed_executor_backend='mp' (the default with it), got "
                  f"{self.distributed_executor_backend!r}.")
            check(self.nnodes == 1, f"async_scheduling=True needs nnodes=1, got nnodes={self.nnodes}.")
            check(self.kv_transfer_config is None,
                  "async_scheduling=True cannot be combined with kv_transfer_config: KV loads and saves run "
                  "step by step.")
            self.distributed_executor_backend = "mp"
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.tensor_parallel_size == 1 else "mp"
        check(self.distributed_executor_backend in ("uni", "mp"),
              f"distributed_executor_backend must be 'uni' or 'mp', got {self.distributed_executor_backend!r}.")
        check(self.distributed_executor_backend == "mp" or (self.tensor_parallel_size == 1 and self.nnodes == 1),
              f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size={self.tensor_parallel_size} "
              "needs 'mp'.")
        check(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1),
              f"num_threads must be a positive integer, got {self.num_threads!r}.")
        check(isinstance(self.generation_config, str) and bool(self.generation_config),
              f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}.")
        check(self.max_logprobs >= -1, f"max_logprobs must be -1 (no limit) or non-negative, got {self.max_logprobs}.")
        for name in ("max_stop_strings", "max_stop_string_len", "max_stop_token_ids"):
            check(isinstance(getattr(self, name), int) and getattr(self, name) >= 0,
                  f"{name} must be a non-negative integer, got {getattr(self, name)!r}.")
        from pagedllm.kv_cache.quant import KV_CACHE_DTYPES, ONE_BYTE_DTYPES

        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}.")
        one_byte = [name for name, dtype in KV_CACHE_DTYPES.items() if dtype in ONE_BYTE_DTYPES]
        check(not self.calculate_kv_scales or KV_CACHE_DTYPES[self.kv_cache_dtype] in ONE_BYTE_DTYPES,
              f"calculate_kv_scales=True needs a one-byte kv_cache_dtype ({one_byte}), got "
              f"kv_cache_dtype={self.kv_cache_dtype!r}.")
        from pagedllm.layers.quantization import validate_quantization

        validate_quantization(self.quantization, self.quantization_group_size)
        if isinstance(self.speculative_config, str):
            self.speculative_config = json.loads(self.speculative_config)
        from pagedllm.distributed.kv_transfer.config import KVTransferConfig

        self.kv_transfer_config = KVTransferConfig.from_any(self.kv_transfer_config)
        check(self.kv_transfer_config is None or self.tensor_parallel_size == 1,
              "kv_transfer_config needs tensor_parallel_size=1: each rank would serve its own shard of the "
              "blocks, and the connector moves one rank's.")
        if self.enable_lora:
            from pagedllm.lora.config import LoRAConfig

            LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # a ValueError naming the field
            check(self.quantization is None,
                  f"enable_lora cannot be combined with quantization={self.quantization!r}: adapters apply to "
                  "full-precision projections only.")
        check(self.kv_transfer_config is None or not self.calculate_kv_scales,
              "kv_transfer_config cannot be combined with calculate_kv_scales=True: each instance would take "
              "its per-layer scales from its own first batch, so one instance's codes would not decode on the "
              "other; use the per-token scales (the default) or a checkpoint's.")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Engine flags (not the model itself: each command decides how the model is given)."""
        group = parser.add_argument_group("engine")
        add = group.add_argument
        bool_flag = argparse.BooleanOptionalAction
        add("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
            help="half = float16, float = float32 (vLLM's names)")
        add("--block-size", type=int, default=16, help="tokens per KV cache block")
        add("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
        add("--max-num-seqs", type=int, default=256, help="most requests running at once")
        add("--max-model-len", type=int, default=None, help="context length (default: the model's)")
        add("--enable-chunked-prefill", action=bool_flag, default=True)
        add("--enable-prefix-caching", action=bool_flag, default=True)
        add("--gpu-memory-utilization", type=float, default=0.9,
            help="share of device memory (on CPU: of available memory) the engine may use")
        add("--kv-cache-memory-bytes", type=int, default=None, help="exact KV cache budget in bytes")
        add("--num-gpu-blocks-override", type=int, default=None, help="exact number of KV blocks")
        add("--kv-cache-dtype", default="auto",
            choices=["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
            help="auto: the model's dtype; fp8 (e4m3), fp8_e5m2, int8: one byte per element plus a scale per "
                 "token and KV head")
        add("--calculate-kv-scales", action=bool_flag, default=False,
            help="one-byte KV caches: one static scale per layer from the first batch instead of per token")
        add("--ignore-sliding-window", action="store_true",
            help="treat every layer as full attention (whole context, every KV block kept) although the model "
                 "has a sliding window; outputs change: for measuring what the window saves")
        add("--attention-backend", default=None,
            choices=["auto", "TORCH_SDPA", "TORCH_FLASH", "CPU_FLASH", "TRITON"],
            help="attention kernels (default: PAGEDLLM_ATTENTION_BACKEND, else CPU_FLASH on CPU, TRITON on CUDA)")
        add("--seed", type=int, default=0)
        add("--device", default="auto", help="auto, cpu or cuda[:N]")
        add("--scheduling-policy", default="fcfs", choices=["fcfs", "lpm"])
        add("--max-logprobs", type=int, default=20)
        add("--speculative-model", default=None, help="draft model directory")
        add("--num-speculative-tokens", type=int, default=None)
        add("--speculative-config", type=json.loads, default=None,
            help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
        add("--tensor-parallel-size", "-tp", type=int, default=1)
        add("--distributed-executor-backend", default=None, choices=["uni", "mp"],
            help="uni: one process; mp: one worker process per tensor-parallel rank (default: uni at TP 1)")
        add("--async-scheduling", action=bool_flag, default=False,
            help="plan the next step while a worker process runs this one (implies "
                 "--distributed-executor-backend mp; not with speculative decoding or KV transfer)")
        add("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks are spread over")
        add("--node-rank", type=int, default=0, help="this host's index (node 0 schedules and serves)")
        add("--dist-init-addr", default=None, help="HOST:PORT of node 0, where all ranks meet (nnodes > 1)")
        add("--enforce-eager", action=bool_flag, default=True,
            help="vLLM's switch that turns off CUDA graphs and torch.compile; pagedllm always runs eagerly (on "
                 "CPU with its linear weights prepacked for oneDNN), so --no-enforce-eager is refused")
        add("--max-stop-strings", type=int, default=128, help="most stop strings one request may give")
        add("--max-stop-string-len", type=int, default=1024, help="longest stop string, in characters")
        add("--max-stop-token-ids", type=int, default=1024, help="most stop_token_ids one request may give")
        add("--num-threads", type=int, default=None,
            help="torch CPU threads (default: $OMP_NUM_THREADS, else one per physical core). On a machine "
                 "shared with other jobs, 1 can be many times faster than 2")
        add("--generation-config", default="auto",
            help="'auto': default sampling from the model's generation_config.json (max_new_tokens, "
                 "do_sample, temperature, top_p, top_k, min_p, repetition_penalty); 'vllm': "
                 "SamplingParams' own defaults; or a directory with a generation_config.json")
        add("--trust-remote-code", action="store_true",
            help="let a tokenizer whose class ships as code in the model directory (auto_map) load, as in "
                 "vLLM; models always run pagedllm's own implementations, and one whose architecture exists "
                 "only as such code is refused")
        add("--quantization", "-q", default=None, choices=["int8", "fp8", "int4", "compressed-tensors"],
            help="weight-only quantization of the linear layers, applied as the weights load (int8: "
            "symmetric per output channel; fp8: e4m3 per output channel; int4: 4-bit with a scale and "
            "an offset per group of --quantization-group-size, 128 by default, bf16 models on CPU); "
            "a checkpoint with a compressed-tensors quantization_config is read as stored")
        add("--kv-transfer-config", default=None,
            help='disaggregated prefill: JSON such as \'{"kv_role": "kv_producer", "kv_port": 14579}\' '
            "(kv_role: kv_producer, kv_consumer or kv_both; optional: kv_connector, kv_ip, kv_port, "
            "engine_id, kv_buffer_size, kv_connector_extra_config.transfer_timeout_s / staging_ttl_s)")
        add("--quantization-group-size", type=int, default=None,
            help="with --quantization int8: one scale per this many input channels instead of per row; "
                 "with int4: the group size (32, 64, 128 or 256)")
        add("--enable-lora", action="store_true", help="serve PEFT LoRA adapters on the base model")
        add("--max-loras", type=int, default=1, help="adapters on the device at once (and in one step)")
        add("--max-lora-rank", type=int, default=16, help="highest adapter rank r accepted")
        add("--max-cpu-loras", type=int, default=None, help="adapters kept in CPU memory (default: --max-loras)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in vars(args).items() if name in names})


@dataclass
class EngineConfig:
    device: torch.device
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None


def choose_kv_cache_groups(model_config: ModelConfig, cache_config: CacheConfig,
                           speculative_config: SpeculativeConfig | None) -> list[tuple[int | None, list[int]]] | None:
    """Separate KV cache groups for full and sliding layers (kv_cache/manager.py), where the model mixes
    them and nothing needs one table for all layers: not with speculative decoding (rejected tokens move a
    request back into blocks a window gave up), a KV connector (it ships one table per request) or a
    one-byte cache (its static scales are looked up per cache tensor, which groups share)."""
    groups = kv_cache_groups(model_config.sliding_window, model_config.layer_types)
    if groups is None:
        return None
    why = ("speculative decoding" if speculative_config is not None
           else "a KV connector" if cache_config.kv_transfer_config is not None
           else "a one-byte kv_cache_dtype" if KV_CACHE_DTYPES.get(cache_config.kv_cache_dtype) in ONE_BYTE_DTYPES
           else None)
    if why is not None:
        logger.info("sliding window %d on some layers: every KV block is kept for every layer (%s needs one "
                    "block table for all layers)", model_config.sliding_window, why)
        return None
    return groups


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Every config the engine and its workers run with, validated (the same on every node)."""
    if args.model is None:
        raise ValueError("model must be given: a local Hugging Face model directory.")
    device = resolve_device(args.device)
    model_config = ModelConfig.from_pretrained(args.model, args.dtype, args.max_model_len, device,
                                               args.quantization, args.quantization_group_size,
                                               trust_remote_code=args.trust_remote_code,
                                               generation_config=args.generation_config,
                                               hf_overrides=args.hf_overrides,
                                               override_generation_config=args.override_generation_config)
    if args.ignore_sliding_window:
        model_config.sliding_window = model_config.layer_types = None
    max_model_len = model_config.max_model_len
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 2048 if args.enable_chunked_prefill else max(2048, max_model_len)
    elif not args.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_model_len "
                         f"({max_model_len}) when chunked prefill is disabled.")
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy, async_scheduling=args.async_scheduling)
    cache_config = CacheConfig(
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend, kv_transfer_config=args.kv_transfer_config)
    parallel_config = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                     distributed_executor_backend=args.distributed_executor_backend or "uni",
                                     nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr)
    parallel_config.verify_with_model_config(model_config)
    if args.enable_lora:
        from pagedllm.lora.config import LoRAConfig

        model_config.lora_config = LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
        scheduler_config.max_loras = args.max_loras
    speculative_config = SpeculativeConfig.from_engine_args(args, model_config)
    if speculative_config is not None and args.async_scheduling:
        raise ValueError("async_scheduling=True cannot be combined with speculative decoding yet: each step's "
                         "proposals depend on the tokens the previous step accepted.")
    if speculative_config is not None:
        scheduler_config.num_speculative_tokens = speculative_config.num_speculative_tokens
        if speculative_config.method == "draft_model":
            scheduler_config.num_lookahead_tokens = speculative_config.num_speculative_tokens
    cache_config.kv_cache_groups = choose_kv_cache_groups(model_config, cache_config, speculative_config)
    return EngineConfig(device, model_config, scheduler_config, cache_config, parallel_config, speculative_config)
