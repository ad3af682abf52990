"""LLMEngine: the one loop. `step()` = schedule, run the model, update requests, make outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter as TallyCounter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, resolve_device
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from pagedllm.executor.abstract import Executor, ExecutorDeadError
from pagedllm.kv_cache.manager import KVCacheManager, cdiv
from pagedllm.kv_cache.snapshot import KVCacheSnapshot
from pagedllm.metrics.reader import Counter, Gauge, Metric
from pagedllm.outputs import RequestOutput
from pagedllm.platform import configure_threads
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("No tokenizer loaded from %s (%s); only token-id prompts will work.", path, exc)
        return None


@dataclass
class EngineConfig:
    device: torch.device
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Every config the engine and its workers run with, validated (the same on every node)."""
    if args.model is None:
        raise ValueError("model must be given: a local Hugging Face model directory.")
    device = resolve_device(args.device)
    model_config = ModelConfig.from_pretrained(args.model, args.dtype, args.max_model_len, device,
                                               args.quantization, args.quantization_group_size,
                                               trust_remote_code=args.trust_remote_code,
                                               generation_config=args.generation_config)
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
        scheduling_policy=args.scheduling_policy)
    cache_config = CacheConfig(
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend)
    parallel_config = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                     distributed_executor_backend=args.distributed_executor_backend or "uni",
                                     nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr)
    parallel_config.verify_with_model_config(model_config)
    if model_config.quantization is not None and parallel_config.world_size > 1:
        raise ValueError("quantization with tensor_parallel_size > 1 is not supported yet: the quantized "
                         "projections are not sharded; use tensor_parallel_size=1.")
    speculative_config = SpeculativeConfig.from_engine_args(args, model_config)
    if speculative_config is not None:
        scheduler_config.num_speculative_tokens = speculative_config.num_speculative_tokens
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
    def __init__(self, args: EngineArgs):
        if args.node_rank > 0:
            raise ValueError(f"node_rank={args.node_rank}: only node 0 runs the engine; other nodes host their "
                             "ranks (LLM(..., node_rank=R) and `pagedllm serve --node-rank R` do that).")
        self.args = args
        self.num_threads = configure_threads(args.num_threads)  # before the executor: its workers take it
        config = create_engine_config(args)
        self.device = config.device
        self.model_config = config.model_config
        self.scheduler_config = config.scheduler_config
        self.cache_config = config.cache_config
        self.parallel_config = config.parallel_config
        self.speculative_config = config.speculative_config
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)

        executor_class = Executor.get_class(self.parallel_config)
        self.model_executor = executor_class(self.model_config, self.cache_config, self.scheduler_config,
                                             self.parallel_config, self.device, seed=args.seed,
                                             speculative_config=self.speculative_config)
        num_blocks = self.model_executor.determine_num_blocks()
        self.cache_config.num_blocks = num_blocks
        self.model_executor.initialize_kv_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                                 self.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.model_config.eos_token_ids,
                                   self.structured_output_manager)
        self.output_processor = OutputProcessor(self.tokenizer)

        self._counter = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished_reasons: TallyCounter[str] = TallyCounter()
        # user request id -> the exception that ended it in the last step (see step())
        self.failed_requests: dict[str, Exception] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

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
        self.model_executor.shutdown()

    # ---- requests in ----
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids.")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text, token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - len(token_ids)
        params.all_stop_token_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.model_config.eos_token_ids))
        request = Request(request_id, token_ids, params, arrival_time=arrival_time or time.time(), prompt=text)
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)
        self.num_prompt_tokens += len(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("prompt must not be empty.")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}).")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, which is not below max_model_len={max_len}.")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds "
                             f"max_model_len={max_len}; lower max_tokens or shorten the prompt.")
        total = len(token_ids) + (params.max_tokens or max_len - len(token_ids))
        if cdiv(total, self.cache_config.block_size) > self.cache_config.num_blocks:
            raise ValueError(f"prompt plus max_tokens ({total} tokens) can never fit in the KV cache of "
                             f"{self.cache_config.num_blocks * self.cache_config.block_size} tokens.")
        if params.logprobs is not None and params.logprobs > self.args.max_logprobs:
            raise ValueError(f"logprobs must be at most max_logprobs={self.args.max_logprobs}, got {params.logprobs}.")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.args.max_logprobs:
            raise ValueError(f"prompt_logprobs must be at most max_logprobs={self.args.max_logprobs}, "
                             f"got {params.prompt_logprobs}.")
        # Everything below would otherwise fail (or slow every request) inside a step.
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids contains token id {bad[0]}, outside the vocabulary [0, {vocab}).")
        if len(params.stop_token_ids) > self.args.max_stop_token_ids:
            raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} entries; the limit is "
                             f"max_stop_token_ids={self.args.max_stop_token_ids}.")
        if len(params.stop) > self.args.max_stop_strings:
            raise ValueError(f"stop has {len(params.stop)} strings; the limit is "
                             f"max_stop_strings={self.args.max_stop_strings}.")
        longest = max((len(stop) for stop in params.stop), default=0)
        if longest > self.args.max_stop_string_len:
            raise ValueError(f"stop has a string of {longest} characters; the limit is "
                             f"max_stop_string_len={self.args.max_stop_string_len}.")
        if params.guided_decoding is not None:
            if self.tokenizer is None:
                raise ValueError("guided_decoding needs the model's tokenizer, and this model has none.")
            self.structured_output_manager.compile(params.guided_decoding)  # ValueError if it cannot compile

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            state = self.output_processor.abort(request_id)
            if state is None:
                continue
            ids = [state.root.request_id] + [s.request.request_id for s in state.samples.values()]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.finished_reasons["abort"] += 1

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One scheduling step. A request that makes the model run fail is ended alone: its id lands
        in `failed_requests` (read it after each step) and the other requests carry on."""
        self.failed_requests.clear()
        scheduler_output = self.scheduler.schedule()
        now = time.time()
        for item in scheduler_output.scheduled:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = now
        try:
            model_output = self.model_executor.execute_model(scheduler_output)
        except ExecutorDeadError:
            raise  # a dead worker process is fatal for the engine, not one request's fault
        except Exception as exc:
            if len(scheduler_output.scheduled) <= 1:
                for item in scheduler_output.scheduled:
                    self._fail_request(item.request, exc)
                return []
            return self._isolate_failure(scheduler_output, exc)
        return self._finish_step(scheduler_output, model_output)

    def _isolate_failure(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Run the failed step's requests one at a time: the ones that fail alone are the culprits.

        Safe to retry because a step changes request state only after the model ran: the scheduler
        already allocated every request's slots, so each one can run its part of the plan alone.
        """
        logger.error("engine step of %d requests failed (%s: %s); retrying them one at a time",
                     len(scheduler_output.scheduled), type(exc).__name__, exc)
        outputs: list[RequestOutput] = []
        # Block copies and the finished ids go with the first retry only (copying a block twice is harmless);
        # the step's grammar bitmask is keyed by request id, so every retry can carry it whole.
        copies, finished_req_ids = scheduler_output.blocks_to_copy, scheduler_output.finished_req_ids
        for item in scheduler_output.scheduled:
            if item.request.request_id not in self.scheduler.requests:
                continue  # a sibling of an earlier culprit, ended with it
            single = SchedulerOutput(scheduled=[item], num_batched_tokens=item.num_new_tokens,
                                     blocks_to_copy=copies, preempted_ids=[], finished_req_ids=finished_req_ids,
                                     grammar_bitmask=scheduler_output.grammar_bitmask)
            copies, finished_req_ids = [], set()
            try:
                model_output = self.model_executor.execute_model(single)
            except ExecutorDeadError:
                raise
            except Exception as item_exc:
                self._fail_request(item.request, item_exc)
                continue
            outputs += self._finish_step(single, model_output)
        return outputs

    def _fail_request(self, request: Request, exc: Exception) -> None:
        """End the user request this (sample of a) request belongs to; the error goes to the log only."""
        group_id = request.parent_id or request.request_id
        logger.error("request %s failed inside a step and was ended", group_id, exc_info=exc)
        state = self.output_processor.states.get(group_id)
        for member in ([state.root, *(s.request for s in state.samples.values())] if state else [request]):
            # the failed step may have put hashes on blocks whose KV it never wrote
            self.kv_cache_manager.forget_uncomputed(member)
        self.abort_request(group_id)
        self.failed_requests[group_id] = exc

    def _finish_step(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> list[RequestOutput]:
        updated, finished, forked = self.scheduler.update(scheduler_output, model_output)
        self.output_processor.add_forked(forked)
        now = time.time()
        for request in updated:
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        outputs, stopped = self.output_processor.process(updated)
        self.scheduler.finish_requests([r.request_id for r in stopped], RequestStatus.FINISHED_STOPPED)
        self.scheduler.update_draft_token_ids(model_output.spec_token_ids)
        self.num_generation_tokens += sum(len(t) for t in model_output.sampled_token_ids.values())
        for output in outputs:
            if output.finished:
                output.metrics.finished_time = now
                for completion in output.outputs:
                    self.finished_reasons[completion.finish_reason or "abort"] += 1
        if not self.scheduler.has_unfinished_requests() and self.scheduler.finished_req_ids:
            # Going idle: tell the workers now which requests are gone, so what they hold for them (a
            # draft's KV blocks, their copies of the requests) is freed without waiting for more work.
            self.model_executor.execute_model(self.scheduler.schedule())
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every KV block and every request's block table as of now (GET /kv-cache/state). Call it
        between steps; it only copies numbers, the JSON is built by the snapshot elsewhere."""
        return self.scheduler.kv_cache_snapshot()

    def get_metrics(self) -> list[Metric]:
        kv = self.kv_cache_manager
        metrics: list[Metric] = [
            Gauge("pagedllm:kv_cache_total_blocks", kv.pool.num_blocks),
            Gauge("pagedllm:kv_cache_free_blocks", kv.num_free_blocks),
            Gauge("pagedllm:kv_cache_usage_perc", kv.usage()),
            Gauge("pagedllm:num_cached_blocks", kv.pool.num_cached_blocks),
            Gauge("pagedllm:num_requests_running", self.scheduler.num_running),
            Gauge("pagedllm:num_requests_waiting", len(self.scheduler.waiting)),
            Counter("pagedllm:num_preemptions", self.scheduler.num_preemptions),
            Counter("pagedllm:prompt_tokens", self.num_prompt_tokens),
            Counter("pagedllm:generation_tokens", self.num_generation_tokens),
            Counter("pagedllm:prefix_cache_queries", kv.prefix_cache_queries),
            Counter("pagedllm:prefix_cache_hits", kv.prefix_cache_hits),
        ]
        for reason in ("stop", "length", "abort"):
            metrics.append(Counter("pagedllm:request_success", self.finished_reasons[reason],
                                   {"finished_reason": reason}))
        if self.speculative_config is not None:
            metrics.extend(self.model_executor.collective_rpc("spec_decode_metrics")[0])
        return metrics

    def next_request_id(self) -> str:
        return str(next(self._counter))
