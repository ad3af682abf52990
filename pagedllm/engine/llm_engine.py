"""LLMEngine: the one loop, in-process. `step()` = schedule, run the model, update requests (EngineCore),
then make outputs (OutputProcessor). Also the engine's configuration (create_engine_config)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import Counter as TallyCounter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, kv_cache_groups, resolve_device
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.scheduler import Scheduler
from pagedllm.executor.abstract import Executor
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.kv_cache.quant import KV_CACHE_DTYPES, ONE_BYTE_DTYPES
from pagedllm.kv_cache.snapshot import KVCacheSnapshot
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.reader import Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

__all__ = ["EngineConfig", "LLMEngine", "PromptType", "create_engine_config", "load_tokenizer", "run_worker_node"]


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The model's tokenizer; as in vLLM, one whose class ships as code in the model directory (auto_map in
    tokenizer_config.json) loads only with trust_remote_code=True."""
    from transformers import AutoTokenizer

    from pagedllm.models.gguf import load_gguf_tokenizer, resolve_gguf_file

    gguf_file = resolve_gguf_file(path)
    if gguf_file is not None:  # built from the file's own metadata, as transformers' gguf_file= does
        return load_gguf_tokenizer(gguf_file)
    if not trust_remote_code and "AutoTokenizer" in _read_auto_map(path):
        # checked here: transformers would otherwise ask on a terminal whether to run the code
        raise ValueError(f"the tokenizer in {path!r} is custom code from the model directory (auto_map in "
                         "tokenizer_config.json); pass trust_remote_code=True (--trust-remote-code) to run it.")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("No tokenizer loaded from %s (%s); only token-id prompts will work.", path, exc)
        return None


def _read_auto_map(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            auto_map = json.load(f).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return {}
    return auto_map if isinstance(auto_map, dict) else {}


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
                                               generation_config=args.generation_config)
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
    if model_config.quantization is not None and parallel_config.world_size > 1:
        raise ValueError("quantization with tensor_parallel_size > 1 is not supported yet: the quantized "
                         "projections are not sharded; use tensor_parallel_size=1.")
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
    cache_config.kv_cache_groups = choose_kv_cache_groups(model_config, cache_config, speculative_config)
    return EngineConfig(device, model_config, scheduler_config, cache_config, parallel_config, speculative_config)


def run_worker_node(args: EngineArgs) -> None:
    """node_rank > 0 of a multi-node group: host this node's tensor-parallel ranks until node 0's engine
    shuts them down (only node 0 schedules and serves)."""
    config = create_engine_config(args)
    from pagedllm.executor.multiproc import MultiprocExecutor

    executor = MultiprocExecutor(config.model_config, config.cache_config, config.scheduler_config,
                                 config.parallel_config, config.device, seed=args.seed,
                                 speculative_config=config.speculative_config)
    executor.wait_for_workers()


class LLMEngine:
    """The engine with its core in this process (what `LLM` drives): an InputProcessor (tokenize,
    validate), the EngineCore (schedule, run, update) and an OutputProcessor (detokenize, stop strings,
    output_kind), called in turn by `step()`. The server runs the same core in a process of its own
    instead (AsyncLLMEngine)."""

    def __init__(self, args: EngineArgs):
        if args.node_rank > 0:
            raise ValueError(f"node_rank={args.node_rank}: only node 0 runs the engine; other nodes host their "
                             "ranks (LLM(..., node_rank=R) and `pagedllm serve --node-rank R` do that).")
        self.args = args
        tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
        self.engine_core = EngineCore(args, tokenizer)
        core = self.engine_core
        core.defer_final_outputs = True  # nothing here reads a FINAL_ONLY request's tokens before it ends
        self.num_threads = core.num_threads
        self.device = core.device
        self.model_config = core.model_config
        self.scheduler_config = core.scheduler_config
        self.cache_config = core.cache_config
        self.parallel_config = core.parallel_config
        self.speculative_config = core.speculative_config
        self.input_processor = InputProcessor(args, self.model_config, tokenizer, args.block_size,
                                              self.cache_config.num_blocks, core.structured_output_manager)
        self.output_processor = OutputProcessor(tokenizer)
        self._counter = itertools.count()
        # user request id -> the exception that ended it in the last step (see step())
        self.failed_requests: dict[str, Exception] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    @property
    def tokenizer(self) -> Any:
        return self.input_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        # one tokenizer for both directions (None: a model whose prompts are token ids only)
        self.input_processor.tokenizer = tokenizer
        self.output_processor.tokenizer = tokenizer

    # the core's parts, where tests, benchmarks and the stats log look at them
    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.engine_core.kv_cache_manager

    @property
    def kv_connector(self):  # the scheduler side of a KV connector (disaggregated prefill), or None
        return self.engine_core.kv_connector

    @property
    def model_executor(self) -> Executor:
        return self.engine_core.model_executor

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        return self.engine_core.structured_output_manager

    @property
    def num_prompt_tokens(self) -> int:
        return self.engine_core.num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        return self.engine_core.num_generation_tokens

    @property
    def finished_reasons(self) -> TallyCounter[str]:
        return self.engine_core.finished_reasons

    @property
    def model_runner(self):
        """The model runner, where it lives in this process (distributed_executor_backend='uni')."""
        worker = getattr(self.model_executor, "driver_worker", None)
        if worker is None:
            raise AttributeError("the model runners live in worker processes (distributed_executor_backend='mp')")
        return worker.model_runner

    @property
    def spec_decoder(self):
        """The in-process model runner's speculative decoder (None without speculative decoding)."""
        return self.model_runner.spec_decoder

    def shutdown(self) -> None:
        """Stop the workers (a no-op in one process); the engine cannot step afterwards."""
        self.engine_core.shutdown()

    # ---- requests in ----
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text, core_request = self.input_processor.process(request_id, prompt, params, arrival_time or time.time(),
                                                          lora_request)
        self.engine_core.add_request(core_request)
        self.output_processor.add_request(request_id, text, core_request.prompt_token_ids,
                                          core_request.sampling_params, core_request.arrival_time)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = [request_id for request_id in request_ids if self.output_processor.abort(request_id)]
        self.engine_core.abort_requests(aborted)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One scheduling step. A request that makes the model run fail is ended alone: its id lands
        in `failed_requests` (read it after each step) and the other requests carry on."""
        core_outputs = self.engine_core.step()
        self.failed_requests = dict(self.engine_core.failed_requests)
        for request_id in self.failed_requests:
            self.output_processor.abort(request_id)
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.stop_requests(stopped)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def num_output_tokens(self) -> dict[str, int]:
        """Tokens generated so far by each unfinished request (its samples together), as the core counts
        them: the output processor sees a FINAL_ONLY request's tokens only when it ends."""
        counts: dict[str, int] = {}
        for request in self.engine_core.scheduler.requests.values():
            request_id = request.parent_id or request.request_id
            counts[request_id] = counts.get(request_id, 0) + request.num_output_tokens
        return counts

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every KV block and every request's block table as of now (GET /kv-cache/state)."""
        return self.engine_core.get_kv_cache_snapshot()

    def get_metrics(self) -> list[Metric]:
        return self.engine_core.get_metrics()

    def next_request_id(self) -> str:
        return str(next(self._counter))
