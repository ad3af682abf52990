"""EngineCore: the scheduler, the executor and the KV cache manager, stepping token ids (vLLM V1's name).

It sees token ids in and token ids out, never text: tokenizing, chat templates, detokenizing, stop
strings and the shape of outputs (output_kind) belong to the API process (LLMEngine for `LLM`,
AsyncLLMEngine for the server; see output_processor.py). So the same core runs in-process under `LLM`
and in its own process behind ZeroMQ under the server (core_proc.py), and what crosses that boundary
each step is small: per request, the token ids and logprobs produced since its last output (a delta),
never the whole list again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as TallyCounter
from collections import deque
from collections.abc import Iterable
from typing import Any

from pagedllm.core_types.engine_core import EngineCoreOutput, EngineCoreRequest, engine_request_id
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs, create_engine_config
from pagedllm.engine.request import Request, RequestStatus, sample_params
from pagedllm.engine.scheduler import Scheduler
from pagedllm.executor.abstract import Executor, ExecutorDeadError
from pagedllm.kv_cache.manager import KVCacheManager, blocks_per_request, cdiv
from pagedllm.kv_cache.snapshot import KVCacheSnapshot
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.reader import Counter, Gauge, Histogram, Metric
from pagedllm.platform import configure_threads, freeze_gc_heap
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def describe_kv_cache_groups(groups: list[tuple[int | None, list[int]]] | None, window: int | None,
                             num_layers: int) -> str:
    if groups is None:
        return f"every layer slides over {window} tokens (one KV cache group)"
    num_sliding = sum(len(layers) for group_window, layers in groups if group_window is not None)
    return (f"{len(groups)} KV cache groups of {len(groups[0][1])} layers each, {num_sliding} of {num_layers} "
            f"layers sliding over {next(w for w, _ in groups if w is not None)} tokens")


class EngineCore:
    """Owns the executor (and through it the workers, one per tensor-parallel rank), the KV cache
    manager and the scheduler. Not thread-safe: one thread calls it."""

    def __init__(self, args: EngineArgs, tokenizer: Any = None):
        self.args = args
        self.num_threads = configure_threads(args.num_threads)  # before the executor: its workers take it
        config = create_engine_config(args)
        # grammars compile against the tokenizer's vocabulary, so the core has one (an in-process
        # engine shares its own); loaded before the model, so a bad tokenizer fails fast
        if tokenizer is None:
            tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
        self.config = config
        self.device = config.device
        self.model_config = config.model_config
        self.scheduler_config = config.scheduler_config
        self.cache_config = config.cache_config
        self.parallel_config = config.parallel_config
        self.speculative_config = config.speculative_config
        executor_class = Executor.get_class(self.parallel_config)
        self.model_executor = executor_class(self.model_config, self.cache_config, self.scheduler_config,
                                             self.parallel_config, self.device, seed=args.seed,
                                             speculative_config=self.speculative_config)
        num_blocks = self.model_executor.determine_num_blocks()
        self.cache_config.num_blocks = num_blocks
        self.model_executor.initialize_kv_cache(num_blocks)
        # Blocks out of a window go back to the pool: with one group when every layer slides, with a
        # group per layer type when the model mixes full and sliding layers (config.kv_cache_groups). Not
        # with speculative decoding (rejected tokens move a request's position back, into blocks already
        # given up) nor with a KV connector (it ships whole tables).
        window = self.model_config.uniform_sliding_window
        if window is not None and (self.speculative_config is not None or args.kv_transfer_config is not None):
            logger.info("sliding window %d: every block is kept (speculative decoding or a KV connector)", window)
            window = None
        groups = self.cache_config.kv_cache_groups
        group_windows = [group_window for group_window, _ in groups] if groups is not None else None
        self.cache_config.group_windows = group_windows or [window]
        self.kv_cache_manager = KVCacheManager(
            num_blocks, args.block_size, args.enable_prefix_caching, sliding_window=window,
            kv_cache_groups=group_windows, key_prompt_end=any(self.model_executor.collective_rpc("routes_prompt_rows")))
        group_windows = self.cache_config.group_windows
        if any(group_window is not None for group_window in group_windows):
            per_request = blocks_per_request(group_windows, self.scheduler_config.max_model_len, args.block_size)
            logger.info("KV cache: %s; a request at max_model_len %d holds at most %d blocks (blocks out of the "
                        "window go back to the pool), %d without the window: room for %d such requests",
                        describe_kv_cache_groups(groups, window, self.model_config.num_hidden_layers),
                        self.scheduler_config.max_model_len, per_request,
                        len(group_windows) * cdiv(self.scheduler_config.max_model_len, args.block_size),
                        (num_blocks - 1) // per_request)
        self.structured_output_manager = StructuredOutputManager(tokenizer, self.model_config.vocab_size,
                                                                 self.model_config.eos_token_ids)
        # Disaggregated prefill: the scheduler side of a KV connector (the worker side lives in the workers)
        self.kv_connector = None
        if args.kv_transfer_config is not None:
            from pagedllm.distributed.kv_transfer import make_scheduler_connector

            self.kv_connector = make_scheduler_connector(args.kv_transfer_config, args.block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.model_config.eos_token_ids,
                                   self.structured_output_manager, connector=self.kv_connector)
        self.num_prompt_tokens = 0
        self.finished_reasons: TallyCounter[str] = TallyCounter()
        self.lora_requests: TallyCounter[str] = TallyCounter()  # requests per LoRA adapter name
        # user request id -> the exception that ended it in the last step (see step())
        self.failed_requests: dict[str, Exception] = {}
        # user request id -> n, for requests with parallel samples (their scheduler ids differ)
        self._num_samples: dict[str, int] = {}
        # Set by an in-process LLMEngine: a FINAL_ONLY request without stop strings then gets one output,
        # when it ends, rather than a delta every step that only waits in the output processor (making
        # a step's outputs costs about as much as scheduling it). The server leaves it off: its metrics
        # observe every step's tokens (per-token latencies), whatever the output_kind.
        self.defer_final_outputs = False
        # Async scheduling: the plans sent to the worker whose tokens have not come back, oldest first
        # (at most two: the step running and the one planned behind it).
        self.async_scheduling = self.scheduler_config.async_scheduling
        self._in_flight: deque[SchedulerOutput] = deque()
        freeze_gc_heap()  # what start-up loaded is never scanned by a collection in the loop

    def shutdown(self) -> None:
        if self.kv_connector is not None and self.parallel_config.distributed_executor_backend == "uni":
            self.model_executor.collective_rpc("shutdown_kv_connector")  # frees its port for a next engine
        self.model_executor.shutdown()

    # ---- requests in ----
    def add_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        if request.request_id in self.scheduler.requests or request.request_id in self._num_samples:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        if request.lora_request is not None:
            # Read into every rank's CPU cache now, not in the step that first runs it (a ValueError for a
            # bad adapter fails this request alone)
            self.add_lora(request.lora_request)
            self.lora_requests[request.lora_request.lora_name] += 1
        defer_outputs = (self.defer_final_outputs and not params.stop
                         and params.output_kind is RequestOutputKind.FINAL_ONLY)
        if params.n == 1:
            self.scheduler.add_request(Request(request.request_id, request.prompt_token_ids, params,
                                               arrival_time=request.arrival_time, defer_outputs=defer_outputs,
                                               lora_request=request.lora_request))
        else:
            # Parallel sampling as vLLM V1 does it: n independent requests, one per sample, fanned out here
            # and gathered again by (request id, index) in the output processor. With prefix caching on they
            # share the prompt's full blocks (the first admitted computes them, the others hit them, in the
            # same step if they are admitted together); with it off each computes the prompt itself.
            self._num_samples[request.request_id] = params.n
            for index in range(params.n):
                sample = Request(engine_request_id(request.request_id, index, params.n), request.prompt_token_ids,
                                 sample_params(params, index), arrival_time=request.arrival_time,
                                 parent_id=request.request_id, index=index, defer_outputs=defer_outputs,
                                 lora_request=request.lora_request)
                if index > 0:
                    sample.kv_transfer_params = None  # a KV connector moves the shared prompt once, for sample 0
                self.scheduler.add_request(sample)
        self.num_prompt_tokens += len(request.prompt_token_ids)

    def _member_ids(self, request_id: str) -> list[str]:
        n = self._num_samples.get(request_id, 1)
        return [request_id] + ([engine_request_id(request_id, index, n) for index in range(n)] if n > 1 else [])

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End user requests (every sample of each); unknown or finished ids are ignored."""
        for request_id in request_ids:
            ended = self.scheduler.finish_requests(self._member_ids(request_id), RequestStatus.FINISHED_ABORTED)
            self._num_samples.pop(request_id, None)
            if ended:
                self.finished_reasons["abort"] += 1
        self._flush_finished_if_idle()

    def stop_requests(self, engine_request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """End samples the API process found a stop string in (by their scheduler ids); returns their
        last outputs (no new tokens: the API process has them), which carry the timings."""
        now = time.time()
        outputs = []
        for request in self.scheduler.finish_requests(engine_request_ids, RequestStatus.FINISHED_STOPPED):
            request.stop_reason = None  # the stop string itself is known to the API process
            outputs.append(self._make_output(request, now))
        self._flush_finished_if_idle()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_generation_tokens(self) -> int:
        """Tokens the model produced for requests that took them (async scheduling drops those of requests
        that ended while their step ran)."""
        return self.scheduler.num_sampled_tokens

    # ---- the loop ----
    def step(self) -> list[EngineCoreOutput]:
        """One scheduling step. A request that makes the model run fail is ended alone: its id lands
        in `failed_requests` (read it after each step) and the other requests carry on."""
        self.failed_requests.clear()
        if self.async_scheduling:
            return self._step_async()
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.model_executor.execute_model(scheduler_output)
        except ExecutorDeadError:
            raise  # a dead worker process is fatal for the engine, not one request's fault
        except Exception as exc:
            if len(scheduler_output.requests) <= 1:
                for request in scheduler_output.requests:
                    self._fail_request(request, exc)
                return []
            return self._isolate_failure(scheduler_output, exc)
        return self._finish_step(scheduler_output, model_output)

    def _step_async(self) -> list[EngineCoreOutput]:
        """One step of async scheduling (vLLM's): returns step N's outputs, having sent step N+1's plan to
        the worker before waiting for N. The worker starts N+1 the moment N is done (it appends the tokens
        it samples to its own copies of the requests, so N+1 can compute them), while this process
        updates the requests, makes the outputs and, in the API process, detokenizes: that work leaves
        the critical path. A plan is made ahead only when it cannot depend on the tokens in flight (no
        grammar to advance, blocks to spare: see
        Scheduler.schedule); otherwise this step waits, and the next plan is made after it. A request
        that stops while its next step runs has that step's token dropped; its blocks are freed at once,
        which is safe because the worker runs steps in order, so the step still writing them finishes
        before any later plan's step reuses them. Worker failures end the engine (ExecutorDeadError),
        as they do for any step in worker processes."""
        if not self._in_flight:
            self._start(self.scheduler.schedule())
        if len(self._in_flight) == 1 and self.scheduler.can_schedule_ahead():
            self._start(self.scheduler.schedule(ahead=True))
        if not self._in_flight:
            return []
        scheduler_output = self._in_flight.popleft()
        return self._finish_step(scheduler_output, self.model_executor.get_model_output())

    def _start(self, scheduler_output: SchedulerOutput) -> None:
        # a plan with nothing to run still tells the worker which requests ended and which tables changed
        if (not scheduler_output.is_empty or scheduler_output.finished_req_ids
                or scheduler_output.block_table_changes):
            self.model_executor.execute_model_async(scheduler_output)
            self._in_flight.append(scheduler_output)

    def _drain(self) -> None:
        """Async scheduling, going idle: take the answers of the steps in flight. Every request in them
        has ended (nothing is unfinished), so they bring no output."""
        while self._in_flight:
            scheduler_output = self._in_flight.popleft()
            self.scheduler.update(scheduler_output, self.model_executor.get_model_output())

    def _isolate_failure(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """Run the failed step's requests one at a time: the ones that fail alone are the culprits.

        Safe to retry because a step changes request state only after the model ran: the scheduler
        already allocated every request's slots, so each one can run its part of the plan alone.
        """
        logger.error("engine step of %d requests failed (%s: %s); retrying them one at a time",
                     len(scheduler_output.requests), type(exc).__name__, exc)
        outputs: list[EngineCoreOutput] = []
        # The finished ids go with the first retry only; the step's grammar bitmask is keyed by request id,
        # so every retry can carry it whole, and so can its block-table changes (writing them again changes
        # nothing).
        finished_req_ids = scheduler_output.finished_req_ids
        for item in scheduler_output.scheduled:
            if item.request.request_id not in self.scheduler.requests:
                continue  # a sibling of an earlier culprit, ended with it
            single = SchedulerOutput.of([item], num_batched_tokens=item.num_new_tokens,
                                        finished_req_ids=finished_req_ids,
                                        grammar_bitmask=scheduler_output.grammar_bitmask,
                                        block_table_changes=scheduler_output.block_table_changes)
            finished_req_ids = set()
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
        for member_id in self._member_ids(group_id):
            member = self.scheduler.requests.get(member_id)
            if member is not None:
                # the failed step may have put hashes on blocks whose KV it never wrote
                self.kv_cache_manager.forget_uncomputed(member)
        self.abort_requests([group_id])
        self.failed_requests[group_id] = exc

    def _finish_step(self, scheduler_output: SchedulerOutput,
                     model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        updated, _ = self.scheduler.update(scheduler_output, model_output)
        if model_output.spec_token_ids:
            self.scheduler.update_draft_token_ids(model_output.spec_token_ids)
        now = time.time()
        outputs = [self._make_output(request, now) for request in updated]
        self._flush_finished_if_idle()
        return outputs

    def _make_output(self, request: Request, now: float) -> EngineCoreOutput:
        metrics = request.metrics
        first = request.num_sent_tokens == 0
        start, request.num_sent_tokens = request.num_sent_tokens, request.num_output_tokens
        if request.num_sent_tokens > start:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        # slices of what is new, so a step's message stays the same size however long the output is
        new_token_ids = request.output_token_ids[start:]
        new_logprobs = request.logprobs[start:] if request.logprobs is not None else None
        finish_reason = request.status.finish_reason  # None while it runs
        if finish_reason is not None:
            metrics.finished_time = now
            self.finished_reasons[finish_reason] += 1
            self._forget_group_if_done(request)
        # positional, in field order: keywords cost a third more, for every request every step
        return EngineCoreOutput(
            request.parent_id or request.request_id, request.index, new_token_ids, new_logprobs,
            request.cumulative_logprob if new_logprobs is not None else None,
            finish_reason, request.stop_reason, max(0, request.num_cached_tokens),
            request.prompt_logprobs if first else None,
            metrics if first or finish_reason is not None else None,
            request.kv_transfer_params_out if finish_reason is not None else None)

    def _forget_group_if_done(self, request: Request) -> None:
        group_id = request.parent_id
        if group_id is None or group_id not in self._num_samples:
            return
        if not any(member in self.scheduler.requests for member in self._member_ids(group_id)):
            del self._num_samples[group_id]

    def _flush_finished_if_idle(self) -> None:
        if not self.scheduler.has_unfinished_requests() and self.scheduler.finished_req_ids:
            # Going idle: tell the workers now which requests are gone, so what they hold for them (a
            # draft's KV blocks, their copies of the requests) is freed without waiting for more work.
            self._drain()
            self.model_executor.execute_model_unanswered(self.scheduler.schedule())

    # ---- state read by metrics, the KV-cache page and the stats log ----
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- LoRA adapters (each rank's CPU cache; the device slots follow the steps) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        if not self.scheduler_config.max_loras:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled; start the engine "
                             "with enable_lora=True (--enable-lora).")
        self.model_executor.collective_rpc("add_lora", (lora_request,))
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return all(self.model_executor.collective_rpc("remove_lora", (lora_int_id,)))

    def list_loras(self) -> list[int]:
        return self.model_executor.collective_rpc("list_loras")[0]

    def _lora_metrics(self) -> list[Metric]:
        """vLLM's lora_requests_info (its value the time of the reading, the adapters in its labels) and
        a count of requests per adapter."""
        def names(requests: Iterable[Request]) -> str:
            return ",".join(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))

        metrics: list[Metric] = [Gauge("pagedllm:lora_requests_info", time.time(), {
            "running_lora_adapters": names(self.scheduler.running),
            "waiting_lora_adapters": names(self.scheduler.waiting),
            "max_lora": str(self.scheduler_config.max_loras)})]
        metrics += [Counter("pagedllm:lora_requests", count, {"lora_name": name})
                    for name, count in sorted(self.lora_requests.items())]
        return metrics

    def get_kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every KV block and every request's block table as of now (GET /kv-cache/state). Call it
        between steps; it only copies numbers, the JSON is built by the snapshot elsewhere."""
        return self.scheduler.kv_cache_snapshot()

    def get_metrics(self) -> list[Metric]:
        kv = self.kv_cache_manager
        metrics: list[Metric] = [
            Gauge("pagedllm:kv_cache_total_blocks", kv.pool.num_usable_blocks),  # (less the null block)
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
            # blocks given back because every position that could read them is past the sliding window
            Counter("pagedllm:kv_blocks_freed_by_window", kv.num_window_freed_blocks),
        ]
        for reason in ("stop", "length", "abort"):
            metrics.append(Counter("pagedllm:request_success", self.finished_reasons[reason],
                                   {"finished_reason": reason}))
        if self.scheduler_config.max_loras:
            metrics.extend(self._lora_metrics())
        if self.speculative_config is not None:
            metrics.extend(self.model_executor.collective_rpc("spec_decode_metrics")[0])
        if self.kv_connector is not None:
            staged = self.model_executor.collective_rpc("kv_staging_stats")[0]
            metrics.extend(kv_transfer_metrics(self.kv_connector, self.scheduler.num_waiting_for_kv, staged))
        return metrics


def kv_transfer_metrics(connector: Any, num_waiting_for_kv: int, staged: tuple[int, int]) -> list[Metric]:
    """Disaggregated prefill: bytes moved each way, load times, requests waiting, recomputes."""
    from pagedllm.distributed.kv_transfer.scheduler_side import KV_TRANSFER_SECONDS_BUCKETS

    return [
        *(Counter("pagedllm:kv_transfer_bytes", n, {"direction": d}) for d, n in connector.bytes_total.items()),
        Histogram("pagedllm:kv_transfer_seconds", connector.seconds_sum, buckets=list(KV_TRANSFER_SECONDS_BUCKETS),
                  bucket_counts=list(connector.seconds_bucket_counts), count=connector.seconds_count),
        Gauge("pagedllm:num_requests_waiting_for_kv", num_waiting_for_kv),
        Counter("pagedllm:kv_transfer_fallbacks", connector.num_fallbacks),
        Gauge("pagedllm:kv_transfer_staged_requests", staged[0]),
        Gauge("pagedllm:kv_transfer_staged_bytes", staged[1]),
    ]
