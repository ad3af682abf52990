"""KV-cache snapshot benchmark: what GET /kv-cache/state costs at a large pool (100,000 blocks by default).

Two measurements, both against a baseline taken in the same run:

1. The pool alone (no model): a KVCacheManager of --num-blocks blocks, --fill of them held by requests
   that share a prefix, some finished requests leaving cached blocks between them. Times
   `snapshot()` (the copy made on the engine thread between two steps: the only part that delays a
   step) and `to_dict()` + `json.dumps` (run in a worker thread by the server), with the JSON's size
   and its number of runs.
2. A real engine step: a small random Llama with --num-blocks KV blocks decoding --num-requests
   requests; median step time with and without a snapshot after each step (steps interleaved in
   pairs, so machine load hits both alike), and their ratio.

    pagedllm bench kv-cache-snapshot [--num-blocks 100000] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedllm.benchmarks.reporting import fail, set_num_threads, write_json


@dataclass
class SnapshotBenchResult:
    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_cached_blocks: int
    num_block_tables: int
    copy_ms: float              # median snapshot() time: the engine-thread stall per poll
    copy_cpu_ms: float          # the same in thread CPU time: steadier on a machine shared with other jobs
    to_dict_ms: float           # median to_dict() time, off the engine thread
    to_dict_cpu_ms: float
    json_ms: float              # median json.dumps time, off the engine thread
    json_bytes: int
    num_runs: int               # entries in `blocks` (run-length encoded)
    engine_num_requests: int
    engine_step_ms: float       # median decode step, no snapshot
    engine_step_with_snapshot_ms: float  # median decode step followed by a snapshot
    step_slowdown: float        # engine_step_with_snapshot_ms / engine_step_ms
    engine_step_cpu_ms: float   # the same two in thread CPU time (torch runs on this thread at 1 thread)
    engine_step_with_snapshot_cpu_ms: float
    step_slowdown_cpu: float
    poll_overhead: float        # copy_cpu_ms per second: the engine time the page's 1 s polling takes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _PoolRequest:
    """The few fields the KV cache manager reads from a request."""

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id = request_id
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.all_token_ids = token_ids
        self.num_tokens = len(token_ids)


def _median_ms(fn: Any, num_iters: int) -> tuple[float, float, Any]:
    """Median wall and thread-CPU milliseconds of fn(), and its last result."""
    wall, cpu, result = [], [], None
    for _ in range(num_iters):
        start, start_cpu = time.perf_counter(), time.thread_time()
        result = fn()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu), result


def fill_pool(num_blocks: int, block_size: int, fill: float, num_requests: int, seed: int = 0) -> Any:
    """A manager whose pool is `fill` used by `num_requests` requests sharing a 32-block prefix, with every
    fifth request finished (its blocks cached between the used ones)."""
    from pagedllm.kv_cache.manager import KVCacheManager

    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 30000, (32 * block_size,), generator=generator).tolist()
    blocks_each = max(33, int(num_blocks * fill / num_requests))
    for i in range(num_requests):
        tail = torch.randint(3, 30000, ((blocks_each - 32) * block_size - 3,), generator=generator).tolist()
        request = _PoolRequest(f"req-{i}", prefix + tail)
        cached, num_cached = kv.get_computed_blocks(request, request.num_tokens - 1)
        if not kv.allocate_slots(request, request.num_tokens - num_cached, cached):
            break
        if i % 5 == 4:
            kv.free(request.request_id)
    return kv


def bench_pool(num_blocks: int, block_size: int, fill: float, num_requests: int, num_iters: int) -> dict[str, Any]:
    kv = fill_pool(num_blocks, block_size, fill, num_requests)
    copy_ms, copy_cpu_ms, snapshot = _median_ms(kv.snapshot, num_iters)
    to_dict_ms, to_dict_cpu_ms, state = _median_ms(snapshot.to_dict, num_iters)
    json_ms, _, body = _median_ms(lambda: json.dumps(state, separators=(",", ":")), num_iters)
    return {"num_used_blocks": state["num_blocks_by_state"]["used"],
            "num_cached_blocks": state["num_blocks_by_state"]["cached"],
            "num_block_tables": len(snapshot.block_tables), "copy_ms": copy_ms, "copy_cpu_ms": copy_cpu_ms,
            "to_dict_ms": to_dict_ms, "to_dict_cpu_ms": to_dict_cpu_ms, "json_ms": json_ms,
            "json_bytes": len(body), "num_runs": len(state["blocks"])}


def build_small_model(path: str) -> str:
    """A random Llama small enough that 100,000 KV blocks of 16 tokens take 200 MB (one layer, one KV head of 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def bench_engine_step(num_blocks: int, block_size: int, num_requests: int, prompt_len: int,
                      num_steps: int) -> dict[str, float]:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory(prefix="pagedllm-kv-snapshot-bench-") as tmp:
        engine = LLMEngine(EngineArgs(model=build_small_model(tmp), dtype="float32", block_size=block_size,
                                      num_gpu_blocks_override=num_blocks, max_model_len=4096,
                                      max_num_batched_tokens=max(2048, prompt_len), max_num_seqs=num_requests))
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=4096 - prompt_len - 1, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        engine.add_request(str(i), torch.randint(3, 1024, (prompt_len,), generator=generator).tolist(), params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()  # prefill everything first: only decode steps are compared
    def step_with_snapshot() -> None:
        engine.step()
        engine.get_kv_cache_snapshot()

    plain, plain_cpu, with_snapshot, with_snapshot_cpu = [], [], [], []
    for _ in range(num_steps):  # interleaved pairs: load drift hits both sides alike
        wall, cpu, _ = _median_ms(engine.step, 1)
        plain.append(wall)
        plain_cpu.append(cpu)
        wall, cpu, _ = _median_ms(step_with_snapshot, 1)
        with_snapshot.append(wall)
        with_snapshot_cpu.append(cpu)
    engine.abort_request([str(i) for i in range(num_requests)])
    step_ms, step_cpu_ms = statistics.median(plain), statistics.median(plain_cpu)
    with_ms, with_cpu_ms = statistics.median(with_snapshot), statistics.median(with_snapshot_cpu)
    return {"engine_step_ms": step_ms, "engine_step_with_snapshot_ms": with_ms, "step_slowdown": with_ms / step_ms,
            "engine_step_cpu_ms": step_cpu_ms, "engine_step_with_snapshot_cpu_ms": with_cpu_ms,
            "step_slowdown_cpu": with_cpu_ms / step_cpu_ms}


def run_snapshot_bench(num_blocks: int = 100_000, block_size: int = 16, fill: float = 0.9, num_requests: int = 64,
                       num_iters: int = 9, engine_prompt_len: int = 1024, engine_steps: int = 30
                       ) -> SnapshotBenchResult:
    pool = bench_pool(num_blocks, block_size, fill, num_requests, num_iters)
    steps = bench_engine_step(num_blocks, block_size, num_requests, engine_prompt_len, engine_steps)
    return SnapshotBenchResult(num_blocks=num_blocks, block_size=block_size, engine_num_requests=num_requests,
                               poll_overhead=pool["copy_cpu_ms"] / 1000.0, **pool, **steps)


def format_result(r: SnapshotBenchResult) -> str:
    rows = [
        ("pool", f"{r.num_blocks:,} blocks of {r.block_size}: {r.num_used_blocks:,} used, "
                 f"{r.num_cached_blocks:,} cached, {r.num_block_tables} block tables"),
        ("snapshot() on the engine thread", f"{r.copy_ms:.2f} ms wall, {r.copy_cpu_ms:.2f} ms CPU"),
        ("to_dict() off the engine thread", f"{r.to_dict_ms:.2f} ms wall, {r.to_dict_cpu_ms:.2f} ms CPU"),
        ("json.dumps off the engine thread", f"{r.json_ms:.2f} ms"),
        ("JSON", f"{r.json_bytes:,} bytes, {r.num_runs:,} runs"),
        (f"decode step, {r.engine_num_requests} requests", f"{r.engine_step_ms:.2f} ms wall, "
                                                            f"{r.engine_step_cpu_ms:.2f} ms CPU"),
        ("decode step + snapshot", f"{r.engine_step_with_snapshot_ms:.2f} ms wall ({r.step_slowdown:.3f}x), "
                                   f"{r.engine_step_with_snapshot_cpu_ms:.2f} ms CPU ({r.step_slowdown_cpu:.3f}x)"),
        ("engine time taken by 1 s polling", f"{100 * r.poll_overhead:.2f}%"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--fill", type=float, default=0.9, help="fraction of the pool held by requests (pool part)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=9, help="timed snapshots (pool part; the median counts)")
    parser.add_argument("--engine-prompt-len", type=int, default=1024)
    parser.add_argument("--engine-steps", type=int, default=30, help="(plain, with snapshot) step pairs")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--output-json", default=None)
    return parser


def run_cmd(args: argparse.Namespace) -> int:
    checks = {"num_blocks": 1, "block_size": 1, "num_requests": 1, "num_iters": 1, "engine_prompt_len": 1,
              "engine_steps": 1}
    for name, low in checks.items():
        if getattr(args, name) < low:
            return fail(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    if not 0.0 < args.fill <= 1.0:
        return fail(f"--fill must be in (0, 1], got {args.fill}")
    if args.engine_prompt_len >= 4096:
        return fail(f"--engine-prompt-len must be below 4096, got {args.engine_prompt_len}")
    if (status := set_num_threads(args.num_threads)) is not None:
        return status
    result = run_snapshot_bench(args.num_blocks, args.block_size, args.fill, args.num_requests, args.num_iters,
                                args.engine_prompt_len, args.engine_steps)
    print(format_result(result))
    write_json(args.output_json, result.to_dict())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.kv_cache_snapshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    return run_cmd(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
