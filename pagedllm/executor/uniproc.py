"""UniProcExecutor: the single worker lives in the engine's process; a step is one method call."""

from __future__ import annotations

from typing import Any

from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.worker.request_state import SchedulerOutputEncoder
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.driver_worker = Worker(self.model_config, self.cache_config, self.scheduler_config,
                                    self.parallel_config, self.device, seed=self.seed, rank=0,
                                    speculative_config=self.speculative_config)
        # The worker reads the plan as deltas here too: its runner has one request shape and one path.
        self.encoder = SchedulerOutputEncoder()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.driver_worker.execute_model(self.encoder.encode(scheduler_output))
        assert output is not None  # rank 0
        return output
