"""MultiprocExecutor: one worker process per tensor-parallel rank, started and owned by the engine.

How a step travels: the engine encodes its SchedulerOutput once (only what changed since the last step,
see worker/request_state.py) and writes it down one pipe per worker; every rank runs the forward pass
(its collectives go over torch.distributed: gloo on CPU, NCCL on CUDA) and answers on its pipe, rank 0
with the sampled tokens, the others with None. Pipes rather than a torch.distributed broadcast from the
engine: the engine stays out of the process group, so it never blocks inside a collective, and since
every rank answers every call, a rank that raises is reported by name at once instead of showing up
later as a collective timeout on its peers.

Failure and shutdown: while waiting, the engine watches every pipe and every process; a worker that dies
(EOF on its pipe, or an exit code) or raises makes the call fail at once with ExecutorDeadError naming
the rank, and all workers are stopped. Workers ignore Ctrl-C (the engine decides), and exit on their own
when the engine's process disappears (their parent pid changes), so no process outlives the engine:
not after `LLM.shutdown()`, garbage collection, interpreter exit, SIGTERM or SIGKILL of the engine.

Workers are started as `python -m pagedllm.executor.multiproc` subprocesses, not with multiprocessing's
spawn, so a user's script without an `if __name__ == "__main__"` guard is never re-imported.

Several nodes (nnodes > 1, as in SGLang): every node starts its own ranks, which meet at node 0's
dist_init_addr (torch.distributed's TCP rendezvous). A pipe cannot reach another host, so there the
engine talks to rank 0 alone, and rank 0 relays each call to every rank over a gloo group
(broadcast_object_list), then gathers every rank's answer (all_gather_object) and reports a rank that
raised by its number. Nodes other than 0 run no engine: they host their ranks until rank 0 says stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from pagedllm import envs
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import SchedulerOutput
from pagedllm.executor.abstract import Executor, ExecutorDeadError
from pagedllm.platform import freeze_gc_heap
from pagedllm.worker.request_state import SchedulerOutputEncoder

logger = logging.getLogger(__name__)

# Loading a model and joining the group; generous for a big checkpoint on a slow disk.
STARTUP_TIMEOUT_S = envs.value("PAGEDLLM_WORKER_STARTUP_TIMEOUT_S")
# One call (a step); a worker that is alive but silent this long is taken as hung.
EXECUTE_TIMEOUT_S = envs.value("PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S")
# How often a wait looks at the processes themselves (a dead worker's pipe usually reports EOF at once).
POLL_INTERVAL_S = 0.5
SHUTDOWN_GRACE_S = 5.0


def send(conn: Connection, obj: Any) -> None:
    """Plain pickle, not Connection.send: multiprocessing's pickler would hand tensors over as shared
    file descriptors, which needs a multiprocessing-spawned peer; these workers are plain subprocesses."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def get_open_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class WorkerHandle:
    def __init__(self, rank: int, process: subprocess.Popen, conn: Connection):
        self.rank = rank
        self.process = process
        self.conn = conn

    def describe_exit(self) -> str:
        code = self.process.poll()
        if code is None:
            return "closed its pipe"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"


class MultiprocExecutor(Executor):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        pc = self.parallel_config
        self.encoder = SchedulerOutputEncoder()
        self.workers: list[WorkerHandle] = []
        self.dead: str | None = None
        # steps sent with execute_model_async whose answers are not yet taken
        self._num_in_flight = 0
        # answers to steps sent with execute_model_unanswered, not yet read (they come before any later one)
        self._num_unread_answers = 0
        # Several nodes: calls go to rank 0, which relays them (see the module docstring).
        self.relay = pc.nnodes > 1
        init_method = f"tcp://{pc.dist_init_addr}" if self.relay else f"tcp://127.0.0.1:{get_open_port()}"
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
        if self.device.type == "cpu" and not self.relay:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: rendezvous and traffic over loopback
        first_rank = pc.node_rank * pc.ranks_per_node
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        try:
            for rank in range(first_rank, first_rank + pc.ranks_per_node):
                parent_conn, child_conn = socket.socketpair()
                process = subprocess.Popen(
                    [sys.executable, "-m", "pagedllm.executor.multiproc", "--fd", str(child_conn.fileno()),
                     "--rank", str(rank)], pass_fds=(child_conn.fileno(),), env=env)
                child_conn.close()
                conn = Connection(parent_conn.detach())
                self.workers.append(WorkerHandle(rank, process, conn))
            init = dict(model_config=self.model_config, cache_config=self.cache_config,
                        scheduler_config=self.scheduler_config, parallel_config=pc, device=self.device,
                        seed=self.seed, speculative_config=self.speculative_config,
                        distributed_init_method=init_method,
                        num_threads=torch.get_num_threads())
            for worker in self.workers:
                send(worker.conn, ("init", (), init))
            self._collect(self.workers, STARTUP_TIMEOUT_S, "start-up")
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d tensor-parallel workers (pids %s), rendezvous at %s", len(self.workers),
                    [w.process.pid for w in self.workers], init_method)

    # ---- calls ----
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float = EXECUTE_TIMEOUT_S) -> list[Any]:
        if self.num_steps_in_flight:
            raise RuntimeError(f"collective_rpc({method!r}) while {self.num_steps_in_flight} step(s) are in "
                               "flight: their answers come first; take them with get_model_output()")
        self._send(method, args, kwargs or {})
        return self._receive(method, timeout_s)

    def _send(self, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        self.check_health()
        if self.parallel_config.node_rank != 0:
            raise RuntimeError("only node 0 calls the workers")
        for worker in self._targets:
            try:
                send(worker.conn, (method, args, kwargs))
            except OSError:
                self._fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                           f"{worker.describe_exit()}")

    def _receive(self, what: str, timeout_s: float) -> list[Any]:
        while self._num_unread_answers:  # sent earlier, so answered first: read and dropped
            self._collect(self._targets, EXECUTE_TIMEOUT_S, "execute_model")
            self._num_unread_answers -= 1
        results = self._collect(self._targets, timeout_s, what)
        return results[0] if self.relay else results  # rank 0 relayed: it answers with every rank's result

    @property
    def _targets(self) -> list[WorkerHandle]:
        return self.workers[:1] if self.relay else self.workers

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_model_async(scheduler_output)
        return self.get_model_output()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        # Each worker reads its pipe in order and answers every call, so the steps' answers come back in
        # the order the steps were sent.
        self._send("execute_model", (self.encoder.encode(scheduler_output),), {})
        self._num_in_flight += 1

    def execute_model_unanswered(self, scheduler_output: SchedulerOutput) -> None:
        # Not waited for: the round trip would wake two sleeping processes at the end of every batch.
        self._send("execute_model", (self.encoder.encode(scheduler_output),), {})
        self._num_unread_answers += 1

    @property
    def num_steps_in_flight(self) -> int:
        return self._num_in_flight

    def get_model_output(self) -> ModelRunnerOutput:
        assert self._num_in_flight, "no step in flight"
        self._num_in_flight -= 1
        answer = self._receive("execute_model", EXECUTE_TIMEOUT_S)[0]
        assert answer is not None
        return answer

    def wait_for_workers(self) -> None:
        """A node other than 0: wait while this node's ranks serve rank 0's calls, until they exit."""
        try:
            for worker in self.workers:
                worker.process.wait()
        finally:
            self.shutdown()

    def _collect(self, targets: list[WorkerHandle], timeout_s: float, what: str) -> list[Any]:
        """The answers of `targets` to the call just sent; fails fast on a dead, hung or raising worker
        (and watches every local worker, not only the targets)."""
        results: list[Any] = [None] * len(targets)
        pending = {worker.conn: i for i, worker in enumerate(targets)}
        deadline = time.monotonic() + timeout_s
        while pending:
            for conn in wait(list(pending), timeout=POLL_INTERVAL_S):
                i = pending.pop(conn)  # type: ignore[call-overload]
                worker = targets[i]
                try:
                    status, payload = recv(conn)  # type: ignore[arg-type]
                except (EOFError, OSError):
                    try:  # a closed pipe usually means the process is exiting: report its exit code
                        worker.process.wait(timeout=POLL_INTERVAL_S)
                    except subprocess.TimeoutExpired:
                        pass
                    self._fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                               f"{worker.describe_exit()} during {what}")
                if status == "error":
                    rank, error = payload
                    self._fail(f"tensor-parallel worker rank {rank} raised during {what}:\n{error}")
                results[i] = payload
            for worker in self.workers:
                if worker.process.poll() is not None:
                    self._fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                               f"{worker.describe_exit()} during {what}")
            if pending and time.monotonic() > deadline:
                ranks = sorted(targets[i].rank for i in pending.values())
                self._fail(f"tensor-parallel worker rank(s) {ranks} did not answer {what} within {timeout_s:.0f} s")
        return results

    # ---- failure and shutdown ----
    def _fail(self, message: str) -> None:
        self.dead = message
        self.shutdown()
        raise ExecutorDeadError(message)

    def check_health(self) -> None:
        if self.dead is not None:
            raise ExecutorDeadError(f"the engine's workers are gone: {self.dead}")
        for worker in self.workers:
            if worker.process.poll() is not None:
                self._fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                           f"{worker.describe_exit()}")

    def shutdown(self) -> None:
        if self.dead is None:
            self.dead = "the executor was shut down"
        self._finalizer()


def _stop_workers(workers: list[WorkerHandle]) -> None:
    """Ask each worker to exit, then terminate, then kill whatever is left; reap them all."""
    for worker in workers:
        try:
            send(worker.conn, ("shutdown", (), {}))
        except OSError:
            pass
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.terminate()
    for worker in workers:
        try:
            worker.process.wait(timeout=SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
        worker.conn.close()
    workers.clear()


# ---- the worker process ----
def _exit_with_parent(parent_pid: int) -> None:
    """The engine's process is gone (even by SIGKILL): nothing will ever call us again, so exit."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(fd: int, rank: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the engine decides
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    from pagedllm.worker.worker import Worker

    try:
        method, args, kwargs = recv(conn)
        assert method == "init", method
        try:
            torch.set_num_threads(kwargs.pop("num_threads"))
            worker = Worker(rank=rank, **kwargs)
        except Exception:
            send(conn, ("error", (rank, traceback.format_exc())))
            return 1
        freeze_gc_heap()
        send(conn, ("ok", None))
        # every call in inference mode, entered once (see ModelRunner.execute)
        with torch.inference_mode():
            if worker.parallel_config.nnodes > 1:
                if rank == 0:
                    _serve_relaying(worker, conn)
                else:
                    _serve_relayed(worker)
            else:
                _serve(worker, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    return 0


def _call(worker: Any, method: str, args: tuple, kwargs: dict[str, Any]) -> tuple[str, Any]:
    try:
        return "ok", getattr(worker, method)(*args, **kwargs)
    except Exception:
        return "error", (worker.rank, traceback.format_exc())


def _serve(worker: Any, conn: Connection) -> None:
    """One host: every rank gets each call on its own pipe and answers on it."""
    while True:
        method, args, kwargs = recv(conn)
        if method == "shutdown":
            return
        send(conn, _call(worker, method, args, kwargs))


def _serve_relaying(worker: Any, conn: Connection) -> None:
    """Rank 0 of several nodes: pass each call on to every rank, answer with all their results."""
    from pagedllm.distributed.parallel_state import all_gather_object, broadcast_object

    while True:
        method, args, kwargs = recv(conn)
        try:
            broadcast_object((method, args, kwargs))
        except Exception:
            if method == "shutdown":
                return
            send(conn, ("error", (worker.rank, "lost contact with the other ranks:\n" + traceback.format_exc())))
            return
        if method == "shutdown":
            return
        answers = all_gather_object(_call(worker, method, args, kwargs))
        errors = [payload for status, payload in answers if status == "error"]
        send(conn, ("error", errors[0]) if errors else ("ok", [payload for _, payload in answers]))


def _serve_relayed(worker: Any) -> None:
    """Any other rank of several nodes: take calls from rank 0, send the answer back to it."""
    from pagedllm.distributed.parallel_state import all_gather_object, broadcast_object

    while True:
        method, args, kwargs = broadcast_object()
        if method == "shutdown":
            return
        all_gather_object(_call(worker, method, args, kwargs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A pagedllm tensor-parallel worker (started by the engine).")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    cli = parser.parse_args()
    code = worker_main(cli.fd, cli.rank)
    # Skip the interpreter's teardown (and the process group's, which waits on peers that are exiting
    # too): nothing here outlives the process, and the engine is waiting for us to go.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

