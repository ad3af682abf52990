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
"""

from __future__ import annotations

import argparse
import logging
import os
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

from pagedllm.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, ExecutorDeadError
from pagedllm.worker.request_state import SchedulerOutputEncoder

logger = logging.getLogger(__name__)

# Loading a model and joining the group; generous for a big checkpoint on a slow disk.
STARTUP_TIMEOUT_S = float(os.environ.get("PAGEDLLM_WORKER_STARTUP_TIMEOUT_S", "600"))
# One call (a step); a worker that is alive but silent this long is taken as hung.
EXECUTE_TIMEOUT_S = float(os.environ.get("PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S", "600"))
# How often a wait looks at the processes themselves (a dead worker's pipe usually reports EOF at once).
POLL_INTERVAL_S = 0.5
SHUTDOWN_GRACE_S = 5.0


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
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
        if self.device.type == "cpu":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: rendezvous and traffic over loopback
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        try:
            for rank in range(pc.world_size):
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
                worker.conn.send(("init", (), init))
            self._collect(STARTUP_TIMEOUT_S, "start-up")
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d tensor-parallel workers (pids %s), rendezvous at %s", len(self.workers),
                    [w.process.pid for w in self.workers], init_method)

    # ---- calls ----
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float = EXECUTE_TIMEOUT_S) -> list[Any]:
        self.check_health()
        for worker in self.workers:
            try:
                worker.conn.send((method, args, kwargs or {}))
            except OSError:
                self._fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                           f"{worker.describe_exit()}")
        return self._collect(timeout_s, method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        message = self.encoder.encode(scheduler_output)
        output = self.collective_rpc("execute_model_remote", (message,))[0]
        assert output is not None
        return output

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        """Every worker's answer to the call just sent; fails fast on a dead, hung or raising worker."""
        results: list[Any] = [None] * len(self.workers)
        pending = {worker.conn: i for i, worker in enumerate(self.workers)}
        deadline = time.monotonic() + timeout_s
        while pending:
            for conn in wait(list(pending), timeout=POLL_INTERVAL_S):
                i = pending.pop(conn)  # type: ignore[call-overload]
                worker = self.workers[i]
                try:
                    status, payload = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    try:  # a closed pipe usually means the process is exiting: report its exit code
                        worker.process.wait(timeout=POLL_INTERVAL_S)
                    except subprocess.TimeoutExpired:
                        pass
                    self._fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                               f"{worker.describe_exit()} during {what}")
                if status == "error":
                    self._fail(f"tensor-parallel worker rank {worker.rank} raised during {what}:\n{payload}")
                results[i] = payload
            for i in pending.values():
                worker = self.workers[i]
                if worker.process.poll() is not None:
                    self._fail(f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                               f"{worker.describe_exit()} during {what}")
            if pending and time.monotonic() > deadline:
                ranks = sorted(self.workers[i].rank for i in pending.values())
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
            worker.conn.send(("shutdown", (), {}))
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

    worker = None
    try:
        while True:
            try:
                method, args, kwargs = conn.recv()
            except EOFError:
                break
            if method == "shutdown":
                break
            try:
                if method == "init":
                    torch.set_num_threads(kwargs.pop("num_threads"))
                    worker = Worker(rank=rank, **kwargs)
                    result = None
                else:
                    assert worker is not None
                    result = getattr(worker, method)(*args, **kwargs)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", result))
    except (BrokenPipeError, ConnectionResetError):
        pass
    return 0


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

