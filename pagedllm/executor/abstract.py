"""The executor: how the engine reaches its workers (vLLM V1's layering).

The engine plans once per step (Scheduler + KV cache manager) and hands the plan to the executor, which
runs it on every tensor-parallel rank and returns rank 0's sampled tokens:

- "uni" (UniProcExecutor): one Worker in the engine's own process; today's single-device path, no copies.
- "mp" (MultiprocExecutor): one process per rank, joined in a torch.distributed group (gloo on CPU,
  NCCL on CUDA); each step's plan goes down a pipe to every worker.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch

from pagedllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import SchedulerOutput
from pagedllm.spec_decode import SpeculativeConfig

logger = logging.getLogger(__name__)


class ExecutorDeadError(RuntimeError):
    """A worker died, hung or raised: the engine cannot go on (its ranks no longer agree on state)."""


class Executor(ABC):
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig, device: torch.device, seed: int = 0,
                 speculative_config: SpeculativeConfig | None = None):
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.parallel_config = parallel_config
        self.device = device
        self.seed = seed
        self.speculative_config = speculative_config

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type[Executor]:
        if parallel_config.distributed_executor_backend == "mp":
            from pagedllm.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        from pagedllm.executor.uniproc import UniProcExecutor
        return UniProcExecutor

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call Worker.<method> on every rank; the results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one planned step on every rank; rank 0's sampled tokens."""

    def execute_model_unanswered(self, scheduler_output: SchedulerOutput) -> None:
        """Run a step whose output nobody reads (the empty plan that tells idle workers which requests
        ended). Workers in other processes are not waited for: their answer is dropped before the next
        call's is read."""
        self.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step and return at once (async scheduling); get_model_output() takes its tokens, in
        the order the steps were started. Executors whose workers run in other processes only."""
        raise NotImplementedError(f"{type(self).__name__} runs steps in the engine's process, one at a time")

    def get_model_output(self) -> ModelRunnerOutput:
        """The tokens of the oldest step started with execute_model_async (waits for it)."""
        raise NotImplementedError(f"{type(self).__name__} runs steps in the engine's process, one at a time")

    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every rank: the minimum over ranks (all ranks share one block table)."""
        per_rank = self.collective_rpc("determine_num_blocks")
        if len(per_rank) > 1:
            logger.info("KV blocks that fit, by rank: %s; every rank allocates %d", per_rank, min(per_rank))
        return min(per_rank)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def shutdown(self) -> None:  # noqa: B027 (nothing to stop in one process)
        """Stop every worker (idempotent)."""

    def check_health(self) -> None:  # noqa: B027 (an in-process worker cannot vanish)
        """Raise ExecutorDeadError if a worker is gone."""
