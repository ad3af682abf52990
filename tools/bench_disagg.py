"""Disaggregated prefill/decode against one instance, same load, with `pagedllm bench serve`.

Load: long-output requests (64-token prompts, --decode-output tokens out, all at once: the "running
decodes") and, at the same time, long-prompt requests (--long-input tokens, 8 out) one after another. Run once against a
single `pagedllm serve`, once against `pagedllm router` over a kv_producer and a kv_consumer. Reports
TTFT and p99 ITL of the decode stream, TTFT of the long prompts, and the decode instance's KV transfer
throughput (bytes / seconds from /metrics) next to this machine's memory copy bandwidth, measured in
the same run.

    python tools/bench_disagg.py --model DIR [--long-input 4000] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str], log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*CLI, *args, "--port", str(port)], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(open(log).read()[-3000:])
        time.sleep(0.5)
    raise RuntimeError(f"{args[0]} did not start")


def serve(model: str, max_len: int, log: str, kv: dict | None = None) -> tuple[subprocess.Popen, str]:
    args = ["serve", model, "--max-model-len", str(max_len), "--served-model-name", "m", "--dtype", "float32"]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    return start(args, log)


def bench(url: str, model: str, input_len: int, output_len: int, num: int, concurrency: int,
          out: str, seed: int = 0) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "bench", "serve", "--base-url", url, "--model", "m", "--tokenizer", model,
                             "--input-len", str(input_len), "--output-len", str(output_len), "--num-prompts",
                             str(num), "--max-concurrency", str(concurrency), "--seed", str(seed),
                             "--output-json", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def run_load(url: str, model: str, cfg: argparse.Namespace, tmp: str, tag: str) -> dict:
    decode_out, prompt_out = f"{tmp}/{tag}-decode.json", f"{tmp}/{tag}-prompts.json"
    # the decodes all at once; the long prompts one after another, for as long as the decodes run
    procs = [bench(url, model, 64, cfg.decode_output, cfg.num_decode, cfg.num_decode, decode_out),
             bench(url, model, cfg.long_input, 8, cfg.num_long, 1, prompt_out)]
    for proc in procs:
        assert proc.wait() == 0, f"bench serve failed against {url}"
    return {"decode": json.load(open(decode_out)), "prompts": json.load(open(prompt_out))}


def transfer_figures(m: dict[str, float]) -> dict[str, float]:
    return {"bytes": m.get("pagedllm:kv_transfer_bytes_total", 0),
            "seconds": m.get("pagedllm:kv_transfer_seconds_sum", 0),
            "count": m.get("pagedllm:kv_transfer_seconds_count", 0),
            "fallbacks": m.get("pagedllm:kv_transfer_fallbacks_total", 0)}


def memory_bandwidth_gbs() -> float:
    src = torch.empty(2**28, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9  # read + write


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--long-input", type=int, default=4000)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--num-decode", type=int, default=4)
    parser.add_argument("--decode-output", type=int, default=1024)
    parser.add_argument("--output-json", default=None)
    cfg = parser.parse_args()
    max_len = cfg.long_input + cfg.decode_output + 600  # the random dataset's prompts run a little long
    tmp = tempfile.mkdtemp(prefix="bench_disagg_")
    report: dict = {"config": vars(cfg), "memory_copy_gbs": memory_bandwidth_gbs()}

    single, url = serve(cfg.model, max_len, f"{tmp}/single.log")
    try:
        report["single"] = run_load(url, cfg.model, cfg, tmp, "single")
    finally:
        single.terminate()
        single.wait()

    procs = []
    try:
        prefill, prefill_url = serve(cfg.model, max_len, f"{tmp}/prefill.log",
                                     {"kv_role": "kv_producer", "kv_port": free_port()})
        procs.append(prefill)
        decode, decode_url = serve(cfg.model, max_len, f"{tmp}/decode.log", {"kv_role": "kv_consumer"})
        procs.append(decode)
        router, router_url = start(["router", "--prefill", prefill_url, "--decode", decode_url], f"{tmp}/router.log")
        procs.append(router)
        report["disagg"] = run_load(router_url, cfg.model, cfg, tmp, "disagg")
        m = metrics(decode_url)
        report["transfer"] = transfer_figures(m)
        # The same pulls with nothing else running: what the transport does when it has the cores.
        # (other prompts than the load's: the decode instance holds those in its prefix cache)
        quiet = bench(router_url, cfg.model, cfg.long_input, 1, 3, 1, f"{tmp}/quiet.json", seed=1)
        assert quiet.wait() == 0
        after = transfer_figures(metrics(decode_url))
        report["transfer_quiet"] = {k: after[k] - report["transfer"][k] for k in after}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait()

    for key, what in (("transfer", "under the mixed load"), ("transfer_quiet", "alone")):
        t = report[key]
        gbs = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] else float("nan")
        t["gbs"] = gbs
        print(f"KV transfer {what}: {t['bytes'] / 1e6:.1f} MB in {t['count']:.0f} pulls, {t['seconds']:.3f} s: "
              f"{gbs:.2f} GB/s ({gbs / report['memory_copy_gbs']:.1%} of this machine's "
              f"{report['memory_copy_gbs']:.1f} GB/s memory copy); fallbacks {t['fallbacks']:.0f}")
    print(f"{'':<10} {'decode TTFT p50':>16} {'decode ITL p50':>15} {'decode ITL p99':>15} {'4k TTFT p50':>12} "
          f"{'4k TTFT p99':>12}  (ms)")
    for name in ("single", "disagg"):
        d, p = report[name]["decode"], report[name]["prompts"]
        print(f"{name:<10} {d['ttft_ms']['median']:>16.1f} {d['itl_ms']['median']:>15.1f} {d['itl_ms']['p99']:>15.1f} "
              f"{p['ttft_ms']['median']:>12.1f} {p['ttft_ms']['p99']:>12.1f}")
    if cfg.output_json:
        for name in ("single", "disagg"):
            for part in report[name].values():
                part.pop("raw", None)
        with open(cfg.output_json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
