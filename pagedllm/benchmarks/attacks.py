"""Hostile clients against `pagedllm serve`, run by hand: how many requests each attack sent, how many
5xx it got back, and the worst /health latency seen while it ran (a prober polls /health every 50 ms).

    python -m pagedllm.benchmarks.attacks [--model DIR] [--json-out attacks.json]

It starts its own server (the bundled demo model by default, --max-waiting-requests 64, short read and
write timeouts) and runs, one after another: the issue-22 payloads (huge top_k, out-of-vocabulary
stop_token_ids, non-finite floats, lone surrogates, a 100,000-entry stop list, a looping request chat
template, 64 prompts x n=128), a burst of 300 concurrent requests, a 3.9 MB prompt, 500 slowloris
sockets, 4 never-read streams (n=16, 20 logprobs), and 200 random bodies. A latency figure is a wall-clock
measurement on a shared machine: compare attacks within one run, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

HEALTH_PERIOD_S = 0.05


@dataclass
class AttackResult:
    attack: str
    requests: int
    server_errors: int  # 5xx answers
    worst_health_ms: float
    note: str = ""


class HealthProber:
    """Polls /health from a thread; a failed or missing answer counts as its timeout."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30.0) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                elapsed = time.perf_counter() - start if ok else 30.0
                self.worst_s = max(self.worst_s, elapsed)
                self._stop.wait(HEALTH_PERIOD_S)

    def __enter__(self) -> HealthProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str | None, port: int, log_path: str) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([model] if model else []),
            "--port", str(port), "--served-model-name", "m", "--max-waiting-requests", "64",
            "--read-timeout", "5", "--write-timeout", "10", "--uvicorn-log-level", "warning"]
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log_path}")
    proc.kill()
    raise RuntimeError(f"server not ready; see {log_path}")


def post(url: str, path: str, content: bytes, timeout: float = 120.0) -> int:
    try:
        return httpx.post(f"{url}{path}", content=content, timeout=timeout,
                          headers={"Content-Type": "application/json"}).status_code
    except httpx.HTTPError:
        return 0


def attack_payloads(url: str) -> tuple[int, int, str]:
    chat = '"messages": [{"role": "user", "content": "x"}], "max_tokens": 4'
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    bodies = [
        ("/v1/completions", '{"prompt": "x", "max_tokens": 4, "top_k": 9223372036854775808}'),
        ("/v1/chat/completions", '{' + chat + ', "stop_token_ids": [9000], "min_tokens": 1}'),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 4, "temperature": Infinity}'),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 4, "repetition_penalty": NaN}'),
        ("/v1/completions", '{"prompt": "x\\ud800", "max_tokens": 4}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4, "stop": [f"s{i}" for i in range(100_000)]})),
        ("/v1/chat/completions", '{' + chat + ', "chat_template_kwargs": {"chat_template": "' + loop + '"}}'),
        ("/v1/chat/completions", '{' + chat + ', "chat_template": "' + loop + '"}'),
        ("/v1/completions", json.dumps({"prompt": [[5, 6, 7]] * 64, "n": 128, "max_tokens": 4})),
    ]
    statuses = [post(url, path, body.encode()) for path, body in bodies]
    return len(bodies), sum(s >= 500 or s == 0 for s in statuses), f"statuses {sorted(set(statuses))}"


def attack_burst(url: str) -> tuple[int, int, str]:
    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300.0) as client:
            async def one(i: int) -> int:
                body = {"prompt": f"burst {i}", "max_tokens": 16, "ignore_eos": True}
                return (await client.post("/v1/completions", json=body)).status_code
            return await asyncio.gather(*(one(i) for i in range(300)))

    statuses = asyncio.run(run())
    peak = waiting_peak(url)
    return 300, sum(s >= 500 and s != 503 for s in statuses), (
        f"{statuses.count(200)} x 200, {statuses.count(503)} x 503, peak waiting {peak:.0f} (limit 64)")


def waiting_peak(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pagedllm:server_waiting_sequences_peak"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def attack_big_prompt(url: str) -> tuple[int, int, str]:
    # under the 4 MB body limit, so it reaches the server's prompt checks
    body = json.dumps({"prompt": "def f(x): return x; " * 195_000, "max_tokens": 4}).encode()
    status = post(url, "/v1/completions", body)
    return 1, int(status >= 500 or status == 0), f"{len(body) / 1e6:.1f} MB -> {status}"


def attack_slowloris(url: str, port: int) -> tuple[int, int, str]:
    sockets = []
    for _ in range(500):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sockets.append(sock)
    closed = 0
    deadline = time.monotonic() + 30
    for sock in sockets:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            closed += sock.recv(1) == b""
        except OSError:
            pass
        sock.close()
    return 500, 0, f"{closed} of 500 closed by the server within 30 s"


def attack_unread_streams(url: str, port: int) -> tuple[int, int, str]:
    body = json.dumps({"prompt": "def", "n": 16, "logprobs": 20, "max_tokens": 1000, "ignore_eos": True,
                       "stream": True}).encode()
    before = aborted(url)
    sockets = []
    for _ in range(4):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        sockets.append(sock)
    # meanwhile an ordinary client is served
    status = post(url, "/v1/completions", b'{"prompt": "def", "max_tokens": 8}')
    deadline = time.monotonic() + 300
    # never read: the server must give up on them itself (--write-timeout) and free their blocks
    while aborted(url) < before + len(sockets) and time.monotonic() < deadline:
        time.sleep(0.5)
    closed = int(aborted(url) - before)
    for sock in sockets:
        sock.close()
    return 5, int(status >= 500 or status == 0), f"{closed} of 4 unread streams aborted; other client {status}"


def aborted(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pagedllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def attack_fuzz(url: str) -> tuple[int, int, str]:
    rng = random.Random(22)
    values = [None, True, 0, -1, 1, 4, 2 ** 63, 10 ** 30, -(2 ** 70), 0.5, 1e30, -1e308, "", "x", "\ud800",
              [], [5, 6], [[5], [6]], ["a", "b"], {"a": 1}, [9000], [-1]]
    fields = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "min_p", "n", "logprobs", "top_logprobs", "stop", "stop_token_ids", "seed", "min_tokens",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "echo", "stream_options",
              "chat_template_kwargs", "ignore_eos", "best_of", "suffix", "model"]
    server_errors = no_answer = 0
    for _ in range(200):
        body = {name: rng.choice(values) for name in rng.sample(fields, rng.randint(1, 8))}
        if isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 4)
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": rng.choice(["hi", "\ud800", ""])}]
        path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
        status = post(url, path, json.dumps(body).encode())
        server_errors += status >= 500
        no_answer += status == 0
    return 200, server_errors, f"{no_answer} without an answer in 120 s (client timeout)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.abspath(f"attacks-server-{port}.log")
    proc = start_server(args.model, port, log_path)
    attacks: list[tuple[str, Callable[[], tuple[int, int, str]]]] = [
        ("idle (baseline)", lambda: (time.sleep(2.0), (0, 0, ""))[1]),
        ("hostile payloads (issue 22)", lambda: attack_payloads(url)),
        ("burst of 300 (limit 64)", lambda: attack_burst(url)),
        ("3.9 MB prompt", lambda: attack_big_prompt(url)),
        ("500 slowloris sockets", lambda: attack_slowloris(url, port)),
        ("4 never-read streams", lambda: attack_unread_streams(url, port)),
        ("200 random bodies", lambda: attack_fuzz(url)),
    ]
    results = []
    try:
        for name, attack in attacks:
            with HealthProber(url) as prober:
                requests, errors, note = attack()
            results.append(AttackResult(name, requests, errors, round(prober.worst_s * 1000, 1), note))
            print(f"{name}: {requests} requests, {errors} x 5xx, worst /health "
                  f"{prober.worst_s * 1000:.0f} ms {note}", flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    print()
    print(f"{'attack':<30} {'requests':>8} {'5xx':>4} {'worst /health':>14}  note")
    for r in results:
        print(f"{r.attack:<30} {r.requests:>8} {r.server_errors:>4} {r.worst_health_ms:>11.0f} ms  {r.note}")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump([asdict(r) for r in results], out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
