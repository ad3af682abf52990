"""The scheduler: each step, decide which requests compute how many tokens.

Its unit is tokens, not phases (vLLM V1): every running request tries to bring `num_computed_tokens`
up to its known tokens (prompt, outputs, speculative proposals) within `max_num_batched_tokens`.
Decode-phase requests go first so decoding never stalls behind a long prompt; then unfinished prefills;
then waiting requests are admitted, taking their cached prefix from the KV cache manager. When blocks
run out the most recently admitted request is preempted (freed, recomputed later); nothing is lost.
It never touches a tensor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from itertools import repeat

from pagedllm.config import SchedulerConfig
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import SchedulerOutput
from pagedllm.distributed.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.kv_cache.snapshot import KVCacheSnapshot, RequestBlocks
from pagedllm.structured_output import StructuredOutputManager


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 eos_token_ids: Iterable[int] = (),
                 structured_output_manager: StructuredOutputManager | None = None,
                 connector: KVConnectorScheduler | None = None):
        self.config = config
        self.connector = connector
        # Requests whose prompt blocks a KV connector is loading: they hold blocks but do not run.
        self.waiting_for_kv: dict[str, Request] = {}
        # Ended while loading: their blocks are freed only once the worker stops writing into them.
        self.aborted_loads: set[str] = set()
        self.structured_output_manager = structured_output_manager
        self.kv = kv_cache_manager
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.finished_req_ids: set[str] = set()
        # Unfinished requests that came with a grammar: while there are none, a plan asks the structured
        # output manager for nothing (no scan of the step's requests).
        self.guided_ids: set[str] = set()
        # Output tokens the model produced for running requests, those past a stop included (a metric).
        self.num_sampled_tokens = 0
        # Async scheduling: a plan made ahead ran short of blocks, or met a request only a plan made after
        # the step in flight may admit, so the next plan waits for that step (and may then preempt:
        # preempting a request whose step is still running is never needed).
        self.needs_sync = False

    # ---- bookkeeping ----
    def add_request(self, request: Request) -> None:
        self._watch_stops(request)
        self.waiting.append(request)
        self.requests[request.request_id] = request
        if request.sampling_params.guided_decoding is not None:
            self.guided_ids.add(request.request_id)

    def _watch_stops(self, request: Request) -> None:
        """Note on the request which tokens may end it (its stop ids, and the EOS ids unless it ignores
        them) and at which token count its length does: update() runs the whole stop test (_check_stop)
        only for a token that is one or reaches the other."""
        params = request.sampling_params
        candidates = set(params.stop_token_ids)
        if not params.ignore_eos:
            candidates |= self.eos_token_ids
        request.stop_candidates = frozenset(candidates)
        cap = self.config.max_model_len
        if params.max_tokens is not None:
            cap = min(cap, request.num_prompt_tokens + params.max_tokens)
        request.length_cap = cap

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv or self.aborted_loads)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif loading:
            del self.waiting_for_kv[request.request_id]
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        if self.connector is not None:
            request.kv_transfer_params_out = self.connector.request_finished(request)
        if loading:
            self.aborted_loads.add(request.request_id)  # the worker may still be writing its blocks
        else:
            self.kv.free(request.request_id)
        self._forget(request.request_id)
        if self.structured_output_manager is not None:
            self.structured_output_manager.free(request.request_id)

    def _forget(self, request_id: str) -> None:
        """A request leaves the engine: workers are told."""
        del self.requests[request_id]
        self.finished_req_ids.add(request_id)
        self.guided_ids.discard(request_id)

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """The KV cache manager's snapshot plus every unfinished request's place in it. Call it between
        steps, so that block tables, reference counts and token counts agree."""
        snapshot = self.kv.snapshot()
        snapshot.num_preemptions = self.num_preemptions
        snapshot.requests = [
            RequestBlocks(request_id=request.request_id, status=request.status.name.lower(),
                          block_table=snapshot.block_tables.get(request.request_id, []),
                          num_computed_tokens=request.num_computed_tokens,
                          num_cached_tokens=max(request.num_cached_tokens, 0), num_tokens=request.num_tokens,
                          num_prompt_tokens=request.num_prompt_tokens, parent_id=request.parent_id)
            for request in self.requests.values()]
        return snapshot

    # ---- the plan for one step ----
    def can_schedule_ahead(self) -> bool:
        """Whether the next step can be planned before the tokens of the one in flight are known (async
        scheduling). Not when a grammar must see the last token to mask the next, nor after a plan made
        ahead ran out of blocks."""
        if self.needs_sync:
            return False
        for request in self.running:
            if request.sampling_params.guided_decoding is not None:
                return False
        return True

    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """The next step's plan. `ahead`: a step is still running (async scheduling), so requests may hold
        output placeholders; this plan never preempts (a request short of blocks sits this step out and
        the next plan waits for the steps in flight), and admits no request that would stop it."""
        self.needs_sync = False
        budget = self.config.max_num_batched_tokens
        plan = SchedulerOutput([], [], [])
        preempted = plan.preempted_ids
        # The plan's columns, appended to directly (a method call per request costs more than the appends);
        # sample and spec_token_ids say nothing (None) unless some request needs them, set at the end.
        add_request, add_num_new, add_start = plan.requests.append, plan.num_new_tokens.append, plan.start_pos.append
        samples: list[bool] = []
        specs: list[list[int]] = []

        # decodes first, so a long prompt never stalls them
        order = [request for request in self.running if request.num_computed_tokens >= request.num_prompt_tokens]
        if len(order) < len(self.running):
            order += [request for request in self.running if request.num_computed_tokens < request.num_prompt_tokens]
        running = RequestStatus.RUNNING
        chunked_prefill = self.config.enable_chunked_prefill
        allocate_slots = self.kv.allocate_slots
        lookahead_tokens = self.config.num_lookahead_tokens
        for request in order:
            if budget <= 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this pass
            if request.num_output_placeholders and self._length_reached(request):
                continue  # it ends by length when its token in flight arrives
            start = request.num_computed_tokens
            end = request.num_tokens_with_spec
            num_new = end - start
            if num_new <= 0:
                continue
            if num_new > budget:
                if not chunked_prefill:
                    continue
                num_new = budget
            if request.spec_token_ids and start + num_new < end:
                # A cut inside the proposals drops them all: compute only the known tokens this step.
                request.spec_token_ids = []
                end = request.num_tokens_with_spec
                num_new = min(num_new, request.num_tokens - start)
            # (every token known before this step is final: the default num_cacheable_tokens)
            lookahead = self._num_lookahead_tokens(request, num_new) if lookahead_tokens else 0
            if ahead:
                if not allocate_slots(request, num_new, num_lookahead_tokens=lookahead):
                    self.needs_sync = True
                    continue
            else:
                while not allocate_slots(request, num_new, num_lookahead_tokens=lookahead):
                    victim = self._pick_victim(plan, request)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                if request.status is not running:
                    continue
            # (a cut inside the proposals dropped them above: a request still holding some reaches them all)
            add_request(request)
            add_num_new(num_new)
            add_start(start)
            samples.append(start + num_new >= end)
            specs.append(request.spec_token_ids)
            budget -= num_new

        # Admit waiting requests, unless this step had to preempt (memory is short).
        max_loras = self.config.max_loras
        running_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request} if max_loras else set()
        while self.waiting and budget > 0 and not preempted and not self.needs_sync:
            request = self._next_waiting()
            if max_loras and not self._lora_fits(request, running_loras):
                # Its adapter would be one more than the slots: it waits for one to free, and the first
                # request that fits goes ahead of it
                request = next((r for r in self.waiting if self._lora_fits(r, running_loras)), None)
                if request is None:
                    break
            if ahead and request.sampling_params.guided_decoding is not None:
                # Admitted by a plan made after the step in flight (see can_schedule_ahead): ask for one,
                # or it (and everyone queued behind it) would wait until the running requests all end.
                self.needs_sync = True
                break
            if len(self.running) >= self.config.max_num_seqs:
                break
            max_cached = request.num_tokens_with_spec - 1
            if request.prompt_logprobs is not None and len(request.prompt_logprobs) < request.num_prompt_tokens:
                max_cached = 0  # prompt logprobs need the logits of every prompt position (as in vLLM)
            loaded = request.num_computed_tokens > 0
            if loaded:
                # Its blocks were loaded by the KV connector and are already its own.
                cached_blocks, num_cached = [], request.num_computed_tokens
            else:
                cached_blocks, num_cached = self.kv.get_computed_blocks(request, max_cached)
                if self.connector is not None and request.prompt_logprobs is None:
                    num_external, _ = self.connector.get_num_new_matched_tokens(request, num_cached, max_cached)
                    if num_external > 0:
                        if not self._start_kv_load(request, cached_blocks, num_cached, num_external):
                            break
                        continue
            num_new = request.num_tokens_with_spec - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            lookahead = self._num_lookahead_tokens(request, num_new, num_cached) \
                if self.config.num_lookahead_tokens else 0
            if not self.kv.allocate_slots(request, num_new, cached_blocks, num_lookahead_tokens=lookahead):
                break
            if not loaded:
                self.kv.record_prefix_query(request.num_tokens, num_cached)
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.lora_request is not None and max_loras:
                running_loras.add(request.lora_request.lora_int_id)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if num_new > 0:
                # (a waiting request holds no proposals: nothing drafts for it before it runs)
                add_request(request)
                add_num_new(num_new)
                add_start(num_cached)
                samples.append(num_cached + num_new >= request.num_tokens_with_spec)
                specs.append([])
                budget -= num_new
                if request.metrics.first_scheduled_time is None:  # every request is first run from here
                    request.metrics.first_scheduled_time = time.time()

        if not all(samples):
            plan.sample = samples
        if any(specs):
            plan.spec_token_ids = specs
        if self.config.async_scheduling:
            # The next plan may be made before this step's results: it must see this step's tokens as
            # computed, and the tokens it samples as known (placeholders until they arrive).
            for request, num_new, sample in zip(plan.requests, plan.num_new_tokens, plan.sample or repeat(True)):
                request.num_computed_tokens += num_new
                if sample:
                    request.num_output_placeholders += 1
        plan.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return self._finish_plan(plan)

    def _num_lookahead_tokens(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Slots past this step's tokens for the draft model's KV (config.num_lookahead_tokens), short of
        max_model_len: no draft position reaches it."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        return max(0, min(self.config.num_lookahead_tokens, self.config.max_model_len - num_computed - num_new))

    def _finish_plan(self, plan: SchedulerOutput) -> SchedulerOutput:
        """What a plan carries besides its requests: the tables written and the requests ended since the
        last one, a KV connector's transfers, the grammars' masks."""
        plan.block_table_changes = self.kv.take_table_changes()
        plan.finished_req_ids = self._take_finished_req_ids()
        if self.connector is not None:
            plan.block_ids = [self.kv.get_block_ids(request.request_id) for request in plan.requests]
            plan.kv_connector_metadata = self.connector.build_connector_meta(plan.scheduled)
        som = self.structured_output_manager
        if som is not None and self.guided_ids:
            plan.grammar_bitmask = som.grammar_bitmask(plan.scheduled)
        return plan

    def _start_kv_load(self, request: Request, cached_blocks: list, num_cached: int, num_external: int) -> bool:
        """Allocate the blocks of the tokens a KV connector will load and park the request until they
        arrive. The loaded blocks get their prefix-cache hashes only once their KV is there."""
        if not self.kv.allocate_slots(request, num_external, cached_blocks, num_cacheable_tokens=num_cached):
            return False
        self.kv.record_prefix_query(request.num_tokens, num_cached)
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        self.waiting_for_kv[request.request_id] = request
        assert self.connector is not None
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_external)
        request.num_external_tokens = num_external
        return True

    def _update_kv_transfers(self, output: KVConnectorOutput) -> None:
        """Loads that ended: a finished one resumes its request with the loaded tokens computed; a failed
        one gives its blocks back, and the request computes its prompt here (nothing is lost)."""
        assert self.connector is not None
        self.connector.update_connector_output(output)
        for request_id in output.finished_recving | output.failed_recving:
            if request_id in self.aborted_loads:
                self.aborted_loads.discard(request_id)
                self.kv.free(request_id)
                continue
            request = self.waiting_for_kv.pop(request_id, None)
            if request is None:
                continue
            request.status = RequestStatus.WAITING
            if request_id in output.finished_recving:
                request.num_computed_tokens += request.num_external_tokens
            else:
                self.connector.record_fallback()
                self.kv.free(request_id)
                request.num_computed_tokens = 0
            self.waiting.appendleft(request)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.waiting_for_kv)

    def _take_finished_req_ids(self) -> set[str]:
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return finished

    def _lora_fits(self, request: Request, running_loras: set[int]) -> bool:
        """Whether admitting `request` keeps the running requests within max_loras distinct adapters."""
        lora = request.lora_request
        return lora is None or lora.lora_int_id in running_loras or len(running_loras) < self.config.max_loras

    def _next_waiting(self) -> Request:
        if self.config.scheduling_policy == "lpm" and len(self.waiting) > 1:
            # SGLang's longest-prefix-match: admit the request with most cached tokens first.
            def cached_len(request: Request) -> int:
                return self.kv.peek_cached_tokens(request)
            return max(self.waiting, key=cached_len)
        return self.waiting[0]

    def _pick_victim(self, plan: SchedulerOutput, request: Request) -> Request:
        for candidate in reversed(self.running):
            if candidate is not request and candidate not in plan.requests:  # (by identity)
                return candidate
        return request

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # ---- after the forward pass ----
    def update(self, output: SchedulerOutput, model_output: ModelRunnerOutput
               ) -> tuple[list[Request], list[Request]]:
        """Apply a step's results. Returns (requests with new tokens whose outputs are due: all but those
        that defer their outputs until they end, Request.defer_outputs; requests finished by a stop token
        or length). A request's first token sets its metrics' first_token_time."""
        updated: list[Request] = []
        finished: list[Request] = []
        if model_output.kv_connector_output is not None and self.connector is not None:
            self._update_kv_transfers(model_output.kv_connector_output)
        sampled_token_ids = model_output.sampled_token_ids  # in the plan's order (empty: none sampled)
        assert not sampled_token_ids or len(sampled_token_ids) == len(output.requests)
        # logprobs come only for the requests that asked: most steps have none to look up
        all_logprobs, all_sampled_logprobs = model_output.logprobs, model_output.sampled_logprobs
        all_prompt_logprobs = model_output.prompt_logprobs
        async_scheduling = self.config.async_scheduling
        num_sampled = 0
        now = None  # the clock, read once where a request gets its first token
        running = RequestStatus.RUNNING
        for request, num_new, start, sample, spec, tokens in zip(
                output.requests, output.num_new_tokens, output.start_pos, output.sample or repeat(True),
                output.spec_token_ids or repeat(None), sampled_token_ids or repeat(())):
            if async_scheduling:  # its tokens were counted as computed when it was scheduled
                if sample:
                    request.num_output_placeholders -= 1
                if request.is_finished:
                    continue  # ended (stop token, stop string, abort) while this step ran: its token is dropped
            else:
                request.num_computed_tokens += num_new
            if all_prompt_logprobs and request.prompt_logprobs is not None \
                    and request.request_id in all_prompt_logprobs:
                # Entry i belongs to prompt token i: a recompute after preemption rewrites, never appends.
                first = start + 1
                new = all_prompt_logprobs[request.request_id]
                request.prompt_logprobs[first:first + len(new)] = new
            if sample:
                if spec:
                    num_rejected = len(spec) + 1 - len(tokens)
                    if num_rejected > 0:  # KV of rejected speculative tokens is rolled back
                        request.num_computed_tokens -= num_rejected
                        self.kv.trim(request)
                if request.spec_token_ids:
                    request.spec_token_ids = []
                logprobs = all_logprobs.get(request.request_id) if all_logprobs else None
                sampled_logprobs = all_sampled_logprobs.get(request.request_id) if all_sampled_logprobs else None
                num_sampled += len(tokens)
                if not request.output_token_ids and tokens:
                    if now is None:
                        now = time.time()
                    request.metrics.first_token_time = now
                stop_candidates, length_cap = request.stop_candidates, request.length_cap
                for i, token in enumerate(tokens):
                    num_tokens = request.append_output_token(token)
                    if logprobs is not None and request.logprobs is not None:
                        request.logprobs.append(logprobs[i])
                    if sampled_logprobs is not None:
                        request.cumulative_logprob += sampled_logprobs[i]
                    if (token in stop_candidates or num_tokens >= length_cap) and self._check_stop(request, token):
                        finished.append(request)
                        break
                # Tokens past a stop were verified but are not part of the output; their KV stays
                # unreachable until the request is freed.
                if not request.defer_outputs or request.status is not running:
                    updated.append(request)
        self.num_sampled_tokens += num_sampled
        return updated, finished

    def update_draft_token_ids(self, spec_token_ids: dict[str, list[int]]) -> None:
        """Store the proposals drafted past this step's tokens; those of finished requests are dropped."""
        for request_id, tokens in spec_token_ids.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = tokens

    def _length_reached(self, request: Request) -> bool:
        """Whether the request's tokens in flight take it to max_tokens or max_model_len."""
        max_tokens = request.sampling_params.max_tokens
        placeholders = request.num_output_placeholders
        return ((max_tokens is not None and request.num_output_tokens + placeholders >= max_tokens)
                or request.num_tokens + placeholders >= self.config.max_model_len)

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        status = None
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
        if status is None and (
                (params.max_tokens is not None and num_output_tokens >= params.max_tokens)
                or request.num_tokens >= self.config.max_model_len):
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        if status is None:
            return False
        self._finish(request, status)
        return True
