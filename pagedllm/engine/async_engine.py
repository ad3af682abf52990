"""AsyncLLMEngine: one background thread runs the LLMEngine's step() loop that every request feeds.

The model call blocks for the length of a step, so it lives on its own thread and the asyncio loop
stays free to accept requests and stream tokens. LLMEngine is not thread-safe: every call into it
(add_request, abort_request, step, get_metrics) happens on the engine thread. The asyncio side only
queues commands, which the thread applies at the top of each iteration, and the thread hands outputs
back with loop.call_soon_threadsafe into per-request OutputQueues (bounded: one output each). When
there is nothing to do the thread sleeps on a Condition, so an idle server costs no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.metrics.stat_logger import LoggingStatLogger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it was shut down, or a failed step left it unusable)."""


class EngineStepError(RuntimeError):
    """Running this request made a step fail: the engine ended it (the others carry on)."""


class OutputQueue:
    """The undelivered outputs of one or more requests: at most one item per request.

    Outputs are cumulative, so a newer output replaces an older one nobody has read yet: a reader
    that falls behind (a client that does not read its stream) holds one output per request, never
    one per step. An error is never replaced. Runs on the event loop only.
    """

    def __init__(self) -> None:
        self._items: dict[str, RequestOutput | BaseException] = {}
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if isinstance(self._items.get(request_id), BaseException):
            return
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
    """Called on the engine thread; used by the server's metrics for per-token latencies."""

    def on_step(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_ids: list[str]) -> None: ...


def _put_if_open(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass  # the event loop is closed: nobody is left to read this


class RequestStream:
    """The asyncio side of one request: its outputs in order, then the end.

    Several streams may share one queue (a multi-prompt completion): items are tagged with the
    request id so the reader can tell them apart.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop,
                 queue: OutputQueue | None, on_started: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.queue = queue if queue is not None else OutputQueue()
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.finished = False
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
        self.queue.put(self.request_id, item)

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


@dataclass
class _AddCommand:
    request_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float
    stream: RequestStream


@dataclass
class _CallCommand:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


@dataclass
class _Inbox:
    """Commands from the asyncio side, applied by the engine thread at the top of each iteration."""

    adds: list[_AddCommand] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    calls: list[_CallCommand] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.adds or self.aborts or self.calls)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observers: Iterable[StepObserver] = (), log_stats: bool = False) -> None:
        self.engine = engine
        self.observers = list(observers)
        # vLLM's periodic "Avg prompt throughput ... Running ... KV cache usage" line (the server's default)
        self.stat_logger = LoggingStatLogger() if log_stats else None
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None
        # engine-thread state
        self._streams: dict[str, RequestStream] = {}
        self._has_work = False
        # the scheduler's waiting queue as of the engine thread's last look, plus requests submitted
        # that the thread has not taken in yet: what --max-waiting-requests bounds
        self._engine_num_waiting = 0
        self._num_pending_adds = 0  # event-loop state

    @classmethod
    def from_engine_args(cls, engine_args: Any, observers: Iterable[StepObserver] = (),
                         log_stats: bool = False) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(engine_args), observers, log_stats)

    # ---- properties read by the server ----------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_waiting_requests(self) -> int:
        """Requests waiting to be scheduled: in the scheduler's queue or not yet handed to it."""
        return self._engine_num_waiting + self._num_pending_adds

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every request in flight with EngineDeadError, without waiting
        (the event loop calls this when the server's grace period is over)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is left and stop the thread (after the server stopped taking requests)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()  # the engine's worker processes, if it has any

    # ---- requests -------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None, queue: OutputQueue | None = None,
                          on_started: Callable[[], None] | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Raises the engine's ValueError for an invalid prompt or parameters (before any output),
        so the server can answer 400 instead of starting a stream. `on_started` is called once when
        the request stops waiting (its first output, an error, an abort or a refusal).
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop, queue, on_started)
        if self.dead_error is not None or self._stopping:
            stream.started()
            raise EngineDeadError("the engine is not running") from self.dead_error
        command = _AddCommand(request_id, prompt, params, arrival_time or time.time(), stream)
        self._num_pending_adds += 1
        with self._cond:
            self._inbox.adds.append(command)
            self._cond.notify()
        try:
            await stream.accepted
        except asyncio.CancelledError:
            stream.abort()  # the client went away while the request was being queued
            raise
        except BaseException:
            stream.started()
            stream.finished = True
            raise
        finally:
            self._num_pending_adds -= 1
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs of one request; leaving the loop early aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request from the event loop; the engine thread frees its blocks next iteration."""
        with self._cond:
            self._inbox.aborts.append(request_id)
            self._cond.notify()

    async def call_on_engine_thread(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) between two steps, where touching the engine is safe (metrics, ...)."""
        if not self.is_running:
            return fn(self.engine)  # no thread to race with
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._cond:
            self._inbox.calls.append(_CallCommand(fn, loop, future))
            self._cond.notify()
        return await future

    async def get_metrics(self) -> list[Any]:
        return await self.call_on_engine_thread(lambda engine: engine.get_metrics())

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or self._has_work):
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, _Inbox()
                    stopping = self._stopping
                self._apply(inbox)
                if stopping:
                    break
                if self.engine.has_unfinished_requests():
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:
                        self._recover(exc)
                    else:
                        self._publish(outputs)
                        self._fail(list(self.engine.failed_requests))
                self._engine_num_waiting = self._read_num_waiting()  # after steps and aborts alike
                self._has_work = self.engine.has_unfinished_requests()
                if self.stat_logger is not None:
                    self.stat_logger.maybe_log(self.engine, idle=not self._has_work)
        except BaseException as exc:  # a failure we could not recover from: fail every request, loudly
            logger.exception("engine loop died")
            self.dead_error = exc
        finally:
            self._close()

    def _apply(self, inbox: _Inbox) -> None:
        answers: list[tuple[RequestStream, BaseException | None]] = []
        for command in inbox.adds:
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        arrival_time=command.arrival_time)
            except Exception as exc:  # ValueError for bad input; anything else is still per-request
                answers.append((command.stream, exc))
                continue
            self._streams[command.request_id] = command.stream
            answers.append((command.stream, None))
        if inbox.adds:
            # count the new arrivals as waiting before their submitters stop counting them as pending
            self._engine_num_waiting = self._read_num_waiting()
        for stream, error in answers:
            _put_if_open(stream.loop, _set_call_result, stream.accepted, None, error)
        aborted = [request_id for request_id in inbox.aborts if request_id in self._streams]
        if aborted:
            self.engine.abort_request(aborted)
            for request_id in aborted:
                del self._streams[request_id]
            for observer in self.observers:
                observer.on_abort(aborted)
        for call in inbox.calls:
            try:
                result, error = call.fn(self.engine), None
            except Exception as exc:
                result, error = None, exc
            _put_if_open(call.loop, _set_call_result, call.future, result, error)

    def _read_num_waiting(self) -> int:
        # Read every loop iteration: the scheduler's queue itself, not a full metrics snapshot.
        return len(self.engine.scheduler.waiting)

    def _fail(self, request_ids: list[str]) -> None:
        """Requests the engine ended alone because they made a step fail (the rest carry on)."""
        failed = [request_id for request_id in request_ids if request_id in self._streams]
        if not failed:
            return
        for observer in self.observers:
            observer.on_abort(failed)
        for request_id in failed:
            # the exception itself went to the log; the client gets a generic message
            stream = self._streams.pop(request_id)
            _put_if_open(stream.loop, stream._deliver, EngineStepError(
                "the engine failed while running this request and ended it"))

    def _recover(self, exc: Exception) -> None:
        """A step raised outside the model run (a bug): rather than take the server down, abort every
        request in flight, fail their readers, and serve on if that left the engine empty. If it did
        not, the state is not trustworthy and the loop dies (/health turns 503). A request whose own
        model run fails is ended alone by LLMEngine.step (see _fail)."""
        logger.exception("engine step failed; aborting the %d requests in flight", len(self._streams))
        aborted = list(self._streams)
        self.engine.abort_request(aborted)
        for observer in self.observers:
            observer.on_abort(aborted)
        error = EngineStepError("the engine failed while running this request and ended it")
        for stream in self._streams.values():
            _put_if_open(stream.loop, stream._deliver, error)
        self._streams.clear()
        if self.engine.has_unfinished_requests():
            raise EngineDeadError("the engine could not recover from a failed step") from exc

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for observer in self.observers:
            observer.on_step(outputs, now)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted this iteration
            if output.finished:
                del self._streams[output.request_id]
            _put_if_open(stream.loop, stream._deliver, output)

    def _close(self) -> None:
        """Abort everything left, fail its readers, and answer pending calls (on the engine thread)."""
        with self._cond:
            self._stopping = True
            inbox, self._inbox = self._inbox, _Inbox()
        error = EngineDeadError("the engine stopped")
        if self.dead_error is not None:
            error.__cause__ = self.dead_error
        leftover = list(self._streams)
        if leftover:
            try:
                self.engine.abort_request(leftover)
            except Exception:
                logger.exception("abort at shutdown failed")
        for stream in self._streams.values():
            _put_if_open(stream.loop, stream._deliver, error)
        self._streams.clear()
        for command in inbox.adds:
            _put_if_open(command.stream.loop, _set_call_result, command.stream.accepted, None, error)
        for call in inbox.calls:
            _put_if_open(call.loop, _set_call_result, call.future, None, error)


def _set_call_result(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the waiter was cancelled
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
