"""LLMEngine: the one loop, in-process. `step()` = schedule, run the model, update requests (EngineCore),
then make outputs (OutputProcessor)."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter as TallyCounter
from collections.abc import Iterable
from typing import Any

from pagedllm.config import check_model_path
from pagedllm.engine.arg_utils import EngineArgs, create_engine_config
from pagedllm.engine.core import EngineCore
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.scheduler import Scheduler
from pagedllm.executor.abstract import Executor
from pagedllm.inputs import PromptType
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.kv_cache.snapshot import KVCacheSnapshot
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.reader import Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "run_worker_node"]


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
        check_model_path(args.model)  # before the tokenizer's loader reads the path and warns about it
        tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or args.model,
                                                                          args.trust_remote_code)
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
                                              self.cache_config.num_blocks, core.structured_output_manager,
                                              self.cache_config.group_windows,
                                              self.scheduler_config.max_num_batched_tokens)
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

    def get_tokenizer(self) -> Any:
        """vLLM's name for the tokenizer (None with skip_tokenizer_init)."""
        return self.input_processor.tokenizer

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
                                          core_request.sampling_params, core_request.arrival_time,
                                          core_request.lora_request)

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
