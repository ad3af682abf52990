"""The engine core's busy loop, and the process that runs it for the server (vLLM V1's EngineCoreProc).

The loop takes messages from an input queue, steps the EngineCore while it has work, and hands each
step's outputs to `send`; idle, it sleeps on the queue, so an idle server costs no CPU. The same loop
runs on a thread under an in-process client (core_client.InprocCoreClient) and as the main thread of
`python -m pagedllm.engine.core_proc` under the server (core_client.MPCoreClient): there an input
thread moves messages from a ZeroMQ PULL socket into the queue, and `send` writes to a PUSH socket.

Messages in: ("add", EngineCoreRequest), ("abort", [request ids]), ("stop", [scheduler ids a stop string
ended]), ("call", call id, method, args) for metrics and the KV-cache page, ("ack", n) for n "outputs"
messages processed (flow control: MAX_UNACKED_OUTPUTS), ("shutdown",).
Messages out: ("outputs", EngineCoreOutputs), ("result", call id, ok, value), ("add_failed", id, text).

Wire format: pickle protocol 5. Every message is a tuple of our own dataclasses (EngineCoreRequest with
its SamplingParams and guided-decoding spec, EngineCoreOutputs with Logprob dicts, the EngineArgs the
core starts from), which pickle carries without a schema, so an engine option added anywhere (a KV
connector's config, say) reaches the core untouched. The per-step messages are compact because they
hold deltas (core.py) and pickle as (class, values) tuples. Pickle runs code on load, which is fine
here: only the two processes of one server can reach the sockets, which live in a private (0700)
directory. msgspec would need every one of these types declared as a Struct.

The process exits when its parent goes away (EOF on the handshake socket), so no core outlives its
server; its tensor-parallel workers exit with it (they watch their own parent).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedllm.core_types.engine_core import EngineCoreOutputs
from pagedllm.engine.core import EngineCore
from pagedllm.executor.abstract import ExecutorDeadError
from pagedllm.metrics.stat_logger import LoggingStatLogger

logger = logging.getLogger(__name__)

# what a ("call", ...) message may run on the core
UTILITY_METHODS = frozenset({"get_metrics", "get_kv_cache_snapshot", "reset_prefix_cache", "add_lora",
                             "remove_lora", "list_loras"})
# Steps whose outputs the API process has not acknowledged yet before the core waits for it: the core
# may run ahead of a slower API process (detokenizing, JSON) by this much, not without bound, so what
# waits for delivery stays small and a client that hangs up is still heard while its request runs.
MAX_UNACKED_OUTPUTS = 4


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=5)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class EngineCoreDeadError(RuntimeError):
    """The core cannot go on (a failed step left requests it could not abort, or a worker died)."""


class EngineCoreLoop:
    def __init__(self, core: EngineCore, send: Callable[[tuple], None], log_stats: bool = False) -> None:
        self.core = core
        self.send = send
        self.input_queue: queue.Queue[tuple] = queue.Queue()
        self.num_unacked = 0  # "outputs" messages sent and not yet acknowledged with ("ack", n)
        # vLLM's periodic "Avg prompt throughput ... Running ... KV cache usage" line (the server's default)
        self.stat_logger = LoggingStatLogger() if log_stats else None

    def run(self) -> None:
        """Until a ("shutdown",) message; raises when the core cannot go on."""
        with torch.inference_mode():  # entered once, not per step (see ModelRunner.execute)
            self._run()

    def _run(self) -> None:
        core = self.core
        while True:
            can_step = core.has_unfinished_requests() and self.num_unacked < MAX_UNACKED_OUTPUTS
            try:
                message: tuple | None = self.input_queue.get(block=not can_step)
            except queue.Empty:
                message = None
            while message is not None:
                if message[0] == "shutdown":
                    return
                self._handle(message)
                try:
                    message = self.input_queue.get_nowait()
                except queue.Empty:
                    message = None
            if core.has_unfinished_requests() and self.num_unacked < MAX_UNACKED_OUTPUTS:
                try:
                    outputs = core.step()
                except ExecutorDeadError:
                    raise
                except Exception as exc:
                    self._recover(exc)
                else:
                    self._send_outputs(EngineCoreOutputs(outputs, list(core.failed_requests), core.num_waiting))
            if self.stat_logger is not None:
                self.stat_logger.maybe_log(core, idle=not core.has_unfinished_requests())

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        self.num_unacked += 1
        self.send(("outputs", outputs))

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ack":
            self.num_unacked = max(0, self.num_unacked - message[1])
        elif kind == "add":
            request = message[1]
            try:
                self.core.add_request(request)
            except Exception as exc:  # checked in the API process already; anything left is per request
                self.send(("add_failed", request.request_id, str(exc)))
        elif kind == "abort":
            self.core.abort_requests(message[1])
        elif kind == "stop":
            outputs = self.core.stop_requests(message[1])
            if outputs:  # their timings, for the latency histograms
                self._send_outputs(EngineCoreOutputs(outputs, [], self.core.num_waiting))
        elif kind == "call":
            _, call_id, method, args = message
            try:
                if method not in UTILITY_METHODS:
                    raise ValueError(f"unknown engine core method {method!r}")
                result, ok = getattr(self.core, method)(*args), True
            except Exception as exc:
                logger.exception("engine core call %s failed", method)
                result, ok = f"{type(exc).__name__}: {exc}", False
            self.send(("result", call_id, ok, result))
        else:
            raise AssertionError(f"unknown message {kind!r}")

    def _recover(self, exc: Exception) -> None:
        """A step raised outside the model run (a bug): rather than take the server down, abort every
        request in flight and report them failed, and serve on if that left the core empty. If it did
        not, the state is not trustworthy and the loop dies. A request whose own model run fails is
        ended alone by EngineCore.step."""
        scheduler = self.core.scheduler
        in_flight = list(dict.fromkeys(r.parent_id or r.request_id for r in scheduler.requests.values()))
        logger.exception("engine step failed; aborting the %d requests in flight", len(in_flight))
        self.core.abort_requests(in_flight)
        self._send_outputs(EngineCoreOutputs([], in_flight, self.core.num_waiting))
        if self.core.has_unfinished_requests():
            raise EngineCoreDeadError("the engine could not recover from a failed step") from exc


# ---- the process --------------------------------------------------------------------------------

def _watch_parent(conn: Connection) -> None:
    """Exit when the API process goes away (its end of the handshake socket closes)."""
    try:
        while True:
            conn.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)


def run_engine_core(conn: Connection) -> int:
    import zmq

    args, input_address, output_address, log_stats = loads(conn.recv_bytes())
    try:
        core = EngineCore(args)
    except BaseException as exc:
        # the exception itself where it pickles, so the server raises what an in-process engine would
        # (a bad flag stays a one-line ValueError); else its text
        try:
            error = dumps(("error", (exc, traceback.format_exc())))
        except Exception:
            error = dumps(("error", (None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
        conn.send_bytes(error)
        return 1
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs: the API process reads them all
    output_socket.connect(output_address)
    loop = EngineCoreLoop(core, lambda message: output_socket.send(dumps(message), copy=False), log_stats)

    def read_inputs() -> None:
        while True:
            loop.input_queue.put(loads(input_socket.recv()))

    threading.Thread(target=read_inputs, name="pagedllm-core-input", daemon=True).start()
    conn.send_bytes(dumps(("ready", {"config": core.config, "pid": os.getpid()})))
    threading.Thread(target=_watch_parent, args=(conn,), name="pagedllm-core-parent", daemon=True).start()
    try:
        loop.run()
    except BaseException:
        logger.exception("engine core died")
        return 1
    finally:
        core.shutdown()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description="pagedllm engine core process (started by the server)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    cli = parser.parse_args()
    logging.basicConfig(level=cli.log_level, format="%(levelname)s %(name)s: %(message)s")
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group: the server decides
    conn = Connection(socket.socket(fileno=cli.fd).detach())
    sys.exit(run_engine_core(conn))


if __name__ == "__main__":
    main()
