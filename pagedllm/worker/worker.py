"""A Worker: one tensor-parallel rank. It owns its device, its ModelRunner, its shard of the weights and
its shard of the KV cache (its KV heads for every block the engine's KV cache manager hands out).

The executor calls it: in the engine's own process (UniProcExecutor, one rank) or over a pipe in a
process of its own (MultiprocExecutor); either way each step's plan arrives as a WorkerSchedulerOutput.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from pagedllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import WorkerSchedulerOutput
from pagedllm.distributed.parallel_state import collective_bytes, init_distributed_environment
from pagedllm.layers.quantization import QuantizedWeight
from pagedllm.metrics.reader import Metric
from pagedllm.platform import configure_cpu_allocator
from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig, device: torch.device, seed: int = 0, rank: int = 0,
                 speculative_config: SpeculativeConfig | None = None, distributed_init_method: str | None = None):
        self.rank = rank
        self.parallel_config = parallel_config
        tp_size = parallel_config.tensor_parallel_size
        if device.type == "cuda" and tp_size > 1:
            device = torch.device("cuda", rank % parallel_config.ranks_per_node)
            torch.cuda.set_device(device)
        self.device = device
        if device.type == "cpu":
            configure_cpu_allocator()  # before the weights and the first activations are allocated
        if tp_size > 1:
            assert distributed_init_method is not None
            init_distributed_environment(rank, tp_size, distributed_init_method,
                                         backend="nccl" if device.type == "cuda" else "gloo")
        self.model_runner = ModelRunner(model_config, cache_config, scheduler_config, device, seed=seed,
                                        tp_rank=rank, tp_size=tp_size,
                                        ranks_per_host=parallel_config.ranks_per_node if device.type == "cpu" else 1,
                                        speculative_config=speculative_config)
        self.num_computed_tokens = 0  # tokens run through the model, for per-token communication figures

    def add_lora(self, lora_request) -> bool:  # a pagedllm.lora.request.LoRARequest
        """Read an adapter into this rank's CPU cache (ValueError if it is bad)."""
        self.model_runner.require_lora_manager().add_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.model_runner.require_lora_manager().remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.model_runner.require_lora_manager().list_loras()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def routes_prompt_rows(self) -> bool:
        """Whether the model computes prompt rows by another arithmetic than generated ones."""
        return self.model_runner.routes_prompt_rows

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.cache_config.num_blocks = num_blocks
        self.model_runner.allocate_kv_cache(num_blocks)

    def execute_model(self, message: WorkerSchedulerOutput) -> ModelRunnerOutput | None:
        """One step, planned in the engine's process and sent as deltas (by every executor, the in-process
        one included): rank 0 returns the sampled tokens, the others None."""
        self.num_computed_tokens += sum(message.scheduled.num_new_tokens)
        output = self.model_runner.execute(message)
        return output if self.rank == 0 else None

    def live_request_ids(self) -> list[str]:
        """The requests this worker process keeps a copy of (what the engine has not yet said are gone)."""
        return sorted(self.model_runner.input_batch.requests)

    def kv_staging_stats(self) -> tuple[int, int]:
        """(requests, bytes) a KV producer holds now for consumers to pull."""
        connector = self.model_runner.kv_connector
        return connector.staging_stats() if connector is not None else (0, 0)

    def shutdown_kv_connector(self) -> None:
        if self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()
            self.model_runner.kv_connector = None

    def communication_stats(self) -> dict[str, int]:
        """Bytes this rank put through each collective, and the tokens computed meanwhile."""
        return {**{f"{name}_bytes": n for name, n in collective_bytes.items()},
                "num_computed_tokens": self.num_computed_tokens}

    def spec_decode_metrics(self) -> list[Metric]:
        spec_decoder = self.model_runner.spec_decoder
        return spec_decoder.metrics() if spec_decoder is not None else []

    def shard_info(self) -> dict[str, Any]:
        """What this rank holds: bytes of sharded and of replicated weights (and of the weight-only quantized
        projections among them), and its KV cache's shape."""
        runner = self.model_runner
        sharded = replicated = 0
        seen: set[int] = set()
        for name, param in runner.model.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            nbytes = param.numel() * param.element_size()
            if "norm" in name:   # norms (and RoPE tables, which are buffers) are replicated
                replicated += nbytes
            else:
                sharded += nbytes
        quantized = sum(module.nbytes() for module in runner.model.modules() if isinstance(module, QuantizedWeight))
        return {
            "rank": self.rank, "pid": os.getpid(), "sharded_weight_bytes": sharded,
            "quantized_weight_bytes": quantized,
            "replicated_weight_bytes": replicated, "num_kv_heads": runner.num_kv_heads,
            "kv_cache_shape": tuple(runner.kv_caches[0].shape) if runner.kv_caches else None,
            "num_blocks": runner.cache_config.num_blocks,
        }
