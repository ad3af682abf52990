"""LLMEngine: the one loop. `step()` = schedule, run the model, update requests, make outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter as TallyCounter
from collections.abc import Iterable
from typing import Any

from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_device
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv_cache.manager import KVCacheManager, cdiv
from pagedllm.kv_cache.snapshot import KVCacheSnapshot
from pagedllm.metrics.reader import Counter, Gauge, Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import build_spec_decoder
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("No tokenizer loaded from %s (%s); only token-id prompts will work.", path, exc)
        return None


class LLMEngine:
    def __init__(self, args: EngineArgs):
        if args.model is None:
            raise ValueError("model must be given: a local Hugging Face model directory.")
        self.args = args
        self.device = resolve_device(args.device)
        self.model_config = ModelConfig.from_pretrained(args.model, args.dtype, args.max_model_len, self.device,
                                                        args.quantization, args.quantization_group_size)
        max_model_len = self.model_config.max_model_len
        max_num_batched_tokens = args.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if args.enable_chunked_prefill else max(2048, max_model_len)
        elif not args.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_model_len "
                             f"({max_model_len}) when chunked prefill is disabled.")
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy)
        self.cache_config = CacheConfig(
            block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
            attention_backend=args.attention_backend)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)

        self.model_runner = ModelRunner(self.model_config, self.cache_config, self.scheduler_config,
                                        self.device, seed=args.seed)
        num_blocks = self.model_runner.determine_num_blocks()
        self.cache_config.num_blocks = num_blocks
        self.model_runner.allocate_kv_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                                 self.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.model_config.eos_token_ids,
                                   self.structured_output_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.spec_decoder = build_spec_decoder(args, self)

        self._counter = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished_reasons: TallyCounter[str] = TallyCounter()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

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
        scheduler_output = self.scheduler.schedule()
        now = time.time()
        for item in scheduler_output.scheduled:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = now
        if self.spec_decoder is not None:
            model_output = self.spec_decoder.execute(scheduler_output)
        else:
            model_output = self.model_runner.execute(scheduler_output)
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
        self.num_generation_tokens += sum(len(t) for t in model_output.sampled_token_ids.values())
        for output in outputs:
            if output.finished:
                output.metrics.finished_time = now
                for completion in output.outputs:
                    self.finished_reasons[completion.finish_reason or "abort"] += 1
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
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
        if self.spec_decoder is not None:
            metrics.extend(self.spec_decoder.metrics())
        return metrics

    def next_request_id(self) -> str:
        return str(next(self._counter))
