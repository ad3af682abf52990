"""How the API process reaches the engine core: on a thread of its own (InprocCoreClient) or in a
process of its own over ZeroMQ (MPCoreClient, what `pagedllm serve` uses; vLLM V1's core clients).

Both take messages with `send(message)` and hand what the core sends back to `dispatch` (a list of
messages: those that arrived while the event loop was busy go together), and a core that stops to
`on_dead`, both called on the asyncio event loop (see core_proc.py for the messages).

MPCoreClient starts `python -m pagedllm.engine.core_proc` (a plain subprocess, as the tensor-parallel
workers are, so a script without a `__main__` guard is never re-imported), hands it the EngineArgs over
a socket pair, and waits for its "ready" with the engine's config. Requests then go down a ZeroMQ
PUSH socket and outputs come back on a PULL socket, read by a thread. A thread waits on the process:
if it exits while the client is open, `on_dead` runs within moments, whatever the cause (a crash,
SIGKILL, the out-of-memory killer).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm import envs
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_proc import EngineCoreLoop, dumps, loads

logger = logging.getLogger(__name__)

# Loading a model (and starting tensor-parallel workers); generous for a big checkpoint on a slow disk.
STARTUP_TIMEOUT_S = envs.value("PAGEDLLM_ENGINE_CORE_STARTUP_TIMEOUT_S")
SHUTDOWN_TIMEOUT_S = 30.0

Dispatch = Callable[[list[tuple]], None]
OnDead = Callable[[BaseException], None]


class EngineCoreStartupError(RuntimeError):
    """The engine core process failed to start (its error is in the message and the log)."""


class CoreClient:
    config: Any  # the core's EngineConfig

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatch: Dispatch | None = None
        self._on_dead: OnDead | None = None
        self._threads_started = False
        # messages not yet handed to the event loop; while it is busy they pile up here and go as one
        # batch, so an API process that falls behind the core catches up in fewer, larger bites
        self._pending: list[tuple] = []
        self._pending_lock = threading.Lock()
        self._drain_scheduled = False

    def start(self, loop: asyncio.AbstractEventLoop, dispatch: Dispatch, on_dead: OnDead) -> None:
        """Deliver to `loop` from now on (called again with another loop, it moves there)."""
        self._loop, self._dispatch, self._on_dead = loop, dispatch, on_dead
        with self._pending_lock:  # what arrived for a loop that closed goes to this one
            self._drain_scheduled = bool(self._pending)
        if self._drain_scheduled:
            self._post(self._drain)
        if not self._threads_started:
            self._threads_started = True
            self._start_threads()

    def _start_threads(self) -> None:
        raise NotImplementedError

    def send(self, message: tuple) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        raise NotImplementedError

    def _post_dispatch(self, message: tuple) -> None:
        with self._pending_lock:
            self._pending.append(message)
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        self._post(self._drain)

    def _drain(self) -> None:
        with self._pending_lock:
            messages, self._pending = self._pending, []
            self._drain_scheduled = False
        if self._dispatch is not None and messages:
            self._dispatch(messages)

    def _post_dead(self, exc: BaseException) -> None:
        self._post(self._on_dead, exc)

    def _post(self, callback: Callable[..., Any] | None, *args: Any) -> None:
        loop = self._loop
        if loop is None or callback is None:
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: a later start() takes what is pending
            if callback == self._drain:
                with self._pending_lock:
                    self._drain_scheduled = False


class InprocCoreClient(CoreClient):
    """The core in this process, stepped by a thread (for tests and debugging; vLLM's in-process client)."""

    def __init__(self, args: EngineArgs, log_stats: bool = False) -> None:
        from pagedllm.engine.core import EngineCore

        super().__init__()
        self.engine_core = EngineCore(args)
        self.config = self.engine_core.config
        self._core_loop = EngineCoreLoop(self.engine_core, self._post_dispatch, log_stats)
        self._thread: threading.Thread | None = None

    def _start_threads(self) -> None:
        def run() -> None:
            try:
                self._core_loop.run()
            except BaseException as exc:
                logger.exception("engine core loop died")
                self._post_dead(exc)

        self._thread = threading.Thread(target=run, name="pagedllm-engine-core", daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._core_loop.input_queue.put(message)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        self.send(("shutdown",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine_core.shutdown()  # the core's worker processes, if it has any


class MPCoreClient(CoreClient):
    def __init__(self, args: EngineArgs, log_stats: bool = False) -> None:
        import zmq

        super().__init__()
        self._closing = False
        self._reader: threading.Thread | None = None
        # the sockets live in a directory only this user can enter: nobody else can send the core a pickle
        self._socket_dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        input_address = f"ipc://{self._socket_dir}/input"
        output_address = f"ipc://{self._socket_dir}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # queue, never drop: requests and aborts must all arrive
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVTIMEO, 200)  # lets the reader thread notice a shutdown
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
        import socket

        parent_sock, child_sock = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.engine.core_proc", "--fd", str(child_sock.fileno()),
                 "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())],
                pass_fds=(child_sock.fileno(),), env=env)
        finally:
            child_sock.close()
        self._conn = Connection(parent_sock.detach())
        try:
            self._conn.send_bytes(dumps((args, input_address, output_address, log_stats)))
            self.config, self.pid = self._wait_ready()
        except BaseException:
            self.shutdown(timeout=5.0)
            raise
        logger.info("engine core process started (pid %d)", self.pid)

    def _wait_ready(self) -> tuple[Any, int]:
        ready = wait([self._conn], timeout=STARTUP_TIMEOUT_S)
        if not ready:
            raise EngineCoreStartupError(f"the engine core process was not ready after {STARTUP_TIMEOUT_S:g} s")
        try:
            kind, payload = loads(self._conn.recv_bytes())
        except EOFError:
            code = self.process.wait()
            raise EngineCoreStartupError(f"the engine core process exited with code {code} while starting "
                                         "(see the log above)") from None
        if kind == "error":
            exc, text = payload
            if isinstance(exc, Exception):
                logger.debug("engine core start-up failed:\n%s", text)
                raise exc  # the core's own error (a ValueError for a bad argument stays one)
            raise EngineCoreStartupError(f"the engine core failed to start: {text}")
        return payload["config"], payload["pid"]

    def _start_threads(self) -> None:
        import zmq

        def read_outputs() -> None:
            while not self._closing:
                try:
                    data = self._output.recv(copy=False)
                except zmq.Again:
                    continue
                except zmq.ZMQError:
                    return  # closed at shutdown
                self._post_dispatch(loads(data.buffer))

        def watch_process() -> None:
            code = self.process.wait()
            if not self._closing:
                logger.error("the engine core process (pid %d) exited with code %s", self.pid, code)
                self._post_dead(EngineCoreExitedError(f"the engine core process exited with code {code}"))

        self._reader = threading.Thread(target=read_outputs, name="pagedllm-core-output", daemon=True)
        self._reader.start()
        threading.Thread(target=watch_process, name="pagedllm-core-watch", daemon=True).start()

    def send(self, message: tuple) -> None:
        import zmq

        try:
            self._input.send(dumps(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # the core is gone; the process watcher reports it
            logger.warning("could not send to the engine core: %s", exc)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        import zmq

        if self._closing:
            return
        self._closing = True
        if self.process.poll() is None:
            try:
                self._input.send(dumps(("shutdown",)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # not connected (it failed to start): it exits on its own, or is killed below
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
                self.process.kill()
                self.process.wait()
        self._conn.close()
        if self._reader is not None:
            self._reader.join(timeout=5.0)  # it sees _closing within its receive timeout
        self._input.close()
        self._output.close()
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)


class EngineCoreExitedError(RuntimeError):
    """The engine core process exited while the server was using it."""
