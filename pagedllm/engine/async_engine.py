"""AsyncLLMEngine: the server's engine (vLLM V1's AsyncLLM). The API process tokenizes and checks each
request (InputProcessor), hands it to the engine core, and turns the core's per-step deltas into
RequestOutputs (OutputProcessor: detokenizing, stop strings, output_kind) on the asyncio event loop.

The core (scheduler, executor, KV cache) runs in a process of its own behind ZeroMQ (MPCoreClient), so
the model's forward pass never shares a GIL with tokenizing, chat templates, detokenizing or JSON, and
the event loop stays free to accept requests, answer /health and stream. `multiprocess=False` runs the
same core loop on a thread of this process instead (InprocCoreClient: tests and debugging).

Each request's outputs go into its OutputQueue, which holds at most one item per request: a reader
that falls behind gets the outputs it missed folded into one (RequestOutput.add), never one per step.

A core that dies (its process exits, or its loop raises) is noticed at once: every request in flight
ends with EngineDeadError, `is_running` turns false (/health answers 503), and the callbacks in
`dead_callbacks` run (the server exits with a non-zero status; see uvicorn_server.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from pagedllm.core_types.engine_core import EngineCoreOutput, EngineCoreOutputs, merge_core_outputs
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import CoreClient, InprocCoreClient, MPCoreClient
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.platform import freeze_gc_heap
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped (it was shut down, its process died, or a failed step left it unusable)."""


class EngineStepError(RuntimeError):
    """Running this request made a step fail: the engine ended it (the others carry on)."""


class OutputQueue:
    """The undelivered outputs of one or more requests: at most one item per request.

    A newer output is folded into an older one nobody has read yet (appended for DELTA outputs,
    replacing for cumulative ones), so a reader that falls behind (a client that does not read its
    stream) holds one output per request, never one per step. An error is never replaced. Runs on
    the event loop only.
    """

    def __init__(self) -> None:
        self._items: dict[str, RequestOutput | BaseException] = {}
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: RequestOutput | BaseException, aggregate: bool = False) -> None:
        pending = self._items.get(request_id)
        if isinstance(pending, BaseException):
            return
        if isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            pending.add(item, aggregate)
        else:
            self._items[request_id] = item
        self._ready.set()

    def empty(self) -> bool:
        return not self._items

    async def get_batch(self) -> list[tuple[str, RequestOutput | BaseException]]:
        """Every undelivered item, in the order the requests first had one pending."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        batch = list(self._items.items())
        self._items.clear()
        return batch


class StepObserver(Protocol):
    """Called on the event loop with each step's core outputs; the server's metrics use it for
    per-token latencies (independent of the requests' output_kind)."""

    def on_step(self, outputs: list[EngineCoreOutput], now: float) -> None: ...

    def on_abort(self, request_ids: list[str]) -> None: ...


class RequestStream:
    """The asyncio side of one request: its outputs in order, then the end.

    Several streams may share one queue (a multi-prompt completion): items are tagged with the
    request id so the reader can tell them apart.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, queue: OutputQueue | None,
                 on_started: Callable[[], None] | None = None, aggregate: bool = False) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue = queue if queue is not None else OutputQueue()
        self.finished = False
        self.aggregate = aggregate  # DELTA outputs: fold unread ones together
        # called once, when the request stops waiting: at its first output, error or abort
        self._on_started = on_started

    # the methods below run on the event loop thread

    def started(self) -> None:
        callback, self._on_started = self._on_started, None
        if callback is not None:
            callback()

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        self.started()
        if self.finished:
            return  # the reader aborted it, or it already ended
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        self.queue.put(self.request_id, item, self.aggregate)

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        self.started()
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                for _, item in await self.queue.get_batch():
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finished:
                        return
        finally:
            self.abort()  # no-op once finished; frees the blocks of a reader that went away


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, observers: Iterable[StepObserver] = (), log_stats: bool = False,
                 multiprocess: bool = True) -> None:
        self.args = args
        self.observers = list(observers)
        client: CoreClient = MPCoreClient(args, log_stats) if multiprocess else InprocCoreClient(args, log_stats)
        self.client = client
        config = client.config
        self.model_config = config.model_config
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or args.model,
                                                                               args.trust_remote_code)
        self.input_processor = InputProcessor(args, self.model_config, self.tokenizer, args.block_size,
                                              config.cache_config.num_blocks,
                                              group_windows=config.cache_config.group_windows,
                                              max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None
        # run on the event loop when the core dies (the server shuts itself down)
        self.dead_callbacks: list[Callable[[], None]] = []
        self._engine_num_waiting = 0
        freeze_gc_heap()  # this process detokenizes every step: no long collections in its loop

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, observers: Iterable[StepObserver] = (),
                         log_stats: bool = False, multiprocess: bool = True) -> AsyncLLMEngine:
        return cls(engine_args, observers, log_stats, multiprocess)

    @property
    def engine_core(self) -> Any:
        """The EngineCore, where it runs in this process (multiprocess=False)."""
        core = getattr(self.client, "engine_core", None)
        if core is None:
            raise AttributeError("the engine core runs in its own process")
        return core

    @property
    def is_running(self) -> bool:
        return self._started and self.dead_error is None and not self._stopping

    @property
    def num_waiting_requests(self) -> int:
        """Requests waiting to be scheduled, as of the core's last step."""
        return self._engine_num_waiting

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start serving; the core's outputs go to the event loop that submits requests."""
        self._started = True
        try:
            self._bind_loop()
        except RuntimeError:
            pass  # no loop running yet: bound at the first request

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self.client.start(loop, self._dispatch, self._on_core_dead)

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every request in flight with EngineDeadError, without waiting
        (the event loop calls this when the server's grace period is over)."""
        self._stopping = True
        if self._streams:
            self.client.send(("abort", list(self._streams)))
        self._fail_all(EngineDeadError("the engine stopped"))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the core (after the server stopped taking requests); what is left is aborted."""
        self._stopping = True
        self.client.shutdown(timeout if timeout is not None else 30.0)
        self._fail_all(EngineDeadError("the engine stopped"))

    # ---- requests -------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None, queue: OutputQueue | None = None,
                          on_started: Callable[[], None] | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Check a request and hand it to the core.

        Raises ValueError for an invalid prompt or parameters (before any output), so the server can
        answer 400 instead of starting a stream. `on_started` is called once when the request stops
        waiting (its first step in the core, an error or an abort).
        """
        aggregate = isinstance(params, SamplingParams) and params.output_kind is RequestOutputKind.DELTA
        stream = RequestStream(self, request_id, queue, on_started, aggregate)
        if self.dead_error is not None or self._stopping or not self._started:
            stream.started()
            raise EngineDeadError("the engine is not running") from self.dead_error
        self._bind_loop()
        try:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            text, core_request = self.input_processor.process(request_id, prompt, params,
                                                              arrival_time or time.time(), lora_request)
        except BaseException:
            stream.started()
            stream.finished = True
            raise
        self.output_processor.add_request(request_id, text, core_request.prompt_token_ids,
                                          core_request.sampling_params, core_request.arrival_time,
                                          core_request.lora_request)
        self._streams[request_id] = stream
        self.client.send(("add", core_request))
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The RequestOutputs of one request (as its output_kind says); leaving the loop early aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, lora_request=lora_request)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (on the event loop); the core frees its blocks at its next iteration."""
        if self._streams.pop(request_id, None) is None:
            return
        self.output_processor.abort(request_id)
        self.client.send(("abort", [request_id]))
        for observer in self.observers:
            observer.on_abort([request_id])

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run EngineCore.<method>(*args) between two steps, where reading the core is safe."""
        if self.dead_error is not None or not self._started:
            raise EngineDeadError("the engine is not running") from self.dead_error
        self._bind_loop()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self.client.send(("call", call_id, method, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def get_metrics(self) -> list[Any]:
        return await self.call_utility("get_metrics")

    async def get_kv_cache_snapshot(self) -> Any:
        return await self.call_utility("get_kv_cache_snapshot")

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility("reset_prefix_cache")

    # ---- what the core sends (event loop) -------------------------------------------------------

    def _dispatch(self, messages: list[tuple]) -> None:
        """What the core sent since the last call; consecutive steps' outputs are processed as one
        (merge_core_outputs), so an event loop that fell behind decodes each request once per batch."""
        run: list[EngineCoreOutputs] = []
        num_outputs = sum(1 for message in messages if message[0] == "outputs")
        if num_outputs:  # the core may run on (flow control, core_proc.MAX_UNACKED_OUTPUTS)
            self.client.send(("ack", num_outputs))
        for message in messages:
            if message[0] == "outputs":
                run.append(message[1])
                continue
            if run:
                self._process_outputs(merge_core_outputs(run))
                run = []
            self._dispatch_one(message)
        if run:
            self._process_outputs(merge_core_outputs(run))

    def _dispatch_one(self, message: tuple) -> None:
        kind = message[0]
        if kind == "result":
            _, call_id, ok, value = message
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RuntimeError(value))
        elif kind == "add_failed":
            _, request_id, text = message
            self.output_processor.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._deliver(ValueError(text))

    def _process_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        self._engine_num_waiting = core_outputs.num_waiting
        now = time.time()
        for observer in self.observers:
            observer.on_step(core_outputs.outputs, now)
        for core_output in core_outputs.outputs:
            stream = self._streams.get(core_output.request_id)
            if stream is not None:
                stream.started()  # the core took it up (FINAL_ONLY requests have no output yet)
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:
            self.client.send(("stop", stopped))
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if output.finished:
                del self._streams[output.request_id]
            stream._deliver(output)
        failed = [request_id for request_id in core_outputs.failed_request_ids if request_id in self._streams]
        if failed:
            for observer in self.observers:
                observer.on_abort(failed)
            for request_id in failed:
                # the exception itself went to the core's log; the client gets a generic message
                self.output_processor.abort(request_id)
                self._streams.pop(request_id)._deliver(
                    EngineStepError("the engine failed while running this request and ended it"))

    def _on_core_dead(self, exc: BaseException) -> None:
        if self.dead_error is not None or self._stopping:
            return
        self.dead_error = exc
        logger.error("the engine core stopped (%s); failing the %d requests in flight", exc, len(self._streams))
        error = EngineDeadError("the engine core stopped")
        error.__cause__ = exc
        self._fail_all(error)
        for callback in self.dead_callbacks:
            try:
                callback()
            except Exception:
                logger.exception("engine-dead callback failed")

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.output_processor.abort(request_id)
            stream._deliver(error)
        if streams:
            for observer in self.observers:
                observer.on_abort(list(streams))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
