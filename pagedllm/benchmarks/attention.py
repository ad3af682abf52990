"""Attention benchmark: the paged attention backends against gather + SDPA (the reference), in one run.

1. Decode attention time per layer (one query per sequence) at each context and batch size, on the
   demo model's attention shape, with K/V scattered over a shuffled block pool as a long-running
   server leaves them. Achieved KV bytes/s (the K and V bytes each call must read) is reported as a
   fraction of the memory bandwidth measured in the same run (a STREAM-like copy of 512 MiB).
2. One prefill chunk over a cached prefix (the other kernel shape), same comparison.
3. End-to-end decode tokens/s of the demo model at a long context, batch 1 and 16, per backend. The
   sequences of a batch share one long prefix (prefix caching), so the run pays for one long prefill
   instead of sixteen; their KV blocks are therefore shared, which favours caches for both backends.

    pagedllm bench attention [--device auto] [--backend CPU_FLASH] [--contexts 1024,8192,32768]
                             [--batch-sizes 1,16] [--num-threads N] [--skip-e2e] [--output-json F]

On a CUDA device the backend defaults to TRITON, every timed call ends with a synchronize, and only the
wall clock is offered.

Times are the best of --num-iters calls (other processes only ever slow a call down), the two
backends interleaved call by call so that load drifts hit both alike. `--clock cpu` times by the
process's CPU time instead of the wall clock: on a machine shared with other jobs, a single-threaded
run then counts only the cycles it was given (with N threads it counts their sum); the bandwidth probe
uses the same clock.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagedllm.assets import demo_model_path
from pagedllm.attention.backend import AttentionBackend, AttentionMetadata, PrefillSeq
from pagedllm.attention.selector import BACKENDS, get_attn_backend
from pagedllm.benchmarks.reporting import write_json
from pagedllm.planner.hardware import measure_memory_bandwidth, synchronizer

REFERENCE = "TORCH_SDPA"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class KernelRow:
    kind: str            # "decode" or "prefill"
    context: int
    batch: int
    query_len: int
    kv_bytes: int        # K and V bytes one call reads (all sequences, one layer)
    reference_ms: float
    backend_ms: float
    speedup: float
    backend_bw_fraction: float
    reference_bw_fraction: float


@dataclass
class E2ERow:
    context: int
    batch: int
    reference_tok_s: float
    backend_tok_s: float
    speedup: float


@dataclass
class AttentionBenchResult:
    backend: str
    device: str
    dtype: str
    num_threads: int
    clock: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    memory_bandwidth_bytes_per_s: float
    # CPU_FLASH's decode path as compiled for this CPU (attention/cpu_flash.decode_path); "" elsewhere
    decode_path: str = ""
    kernels: list[KernelRow] = field(default_factory=list)
    e2e: list[E2ERow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _step(context: int, batch: int, query_len: int, block_size: int, num_heads: int, num_kv_heads: int,
          head_dim: int, dtype: torch.dtype, seed: int = 0, device: torch.device = torch.device("cpu")
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A KV pool holding `batch` sequences of `context` tokens in shuffled blocks, and the metadata the
    model runner would build for a step where each sequence computes its last `query_len` tokens (made
    on the CPU from one seed, so every device times the same step, then moved to `device`)."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables = torch.tensor(order[:batch * blocks_per_seq]).view(batch, blocks_per_seq)
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    num_tokens = batch * query_len
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    new_kv = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.arange(context - query_len, context)
    slots = (tables[:, positions // block_size] * block_size + positions % block_size).reshape(-1)
    md = AttentionMetadata(slot_mapping=slots)
    md.query_start_loc = torch.arange(batch + 1) * query_len
    md.seq_lens = torch.full((batch,), context)
    md.block_tables = tables
    md.max_query_len, md.max_seq_len = query_len, context
    if query_len == 1:
        md.num_decodes = md.num_decode_tokens = batch
        md.decode_block_tables = tables
        if batch == 1:
            md.decode_seq_len = context
        else:  # all sequences are equally long: nothing to hide
            md.decode_attn_mask = torch.zeros(batch, 1, 1, blocks_per_seq * block_size, dtype=dtype)
            md.decode_attn_mask[..., context:] = float("-inf")
    else:
        for i in range(batch):
            key_pos = torch.arange(context)
            md.prefills.append(PrefillSeq(query_start=i * query_len, query_len=query_len, seq_len=context,
                                          block_table=tables[i],
                                          attn_mask=key_pos[None, :] <= key_pos[context - query_len:, None]))
    if device.type != "cpu":
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "decode_block_tables",
                     "decode_attn_mask"):
            if isinstance(value := getattr(md, name), torch.Tensor):
                setattr(md, name, value.to(device))
        for prefill in md.prefills:
            prefill.block_table, prefill.attn_mask = prefill.block_table.to(device), prefill.attn_mask.to(device)
        query, new_kv, kv_cache, tables = (t.to(device) for t in (query, new_kv, kv_cache, tables))
    return query, new_kv, kv_cache, tables, md


def _time_pair(backends: list[AttentionBackend], args: tuple, num_iters: int, clock,
               device: torch.device = torch.device("cpu")) -> list[float]:
    query, new_kv, kv_cache, md, scale = args
    sync = synchronizer(device)
    for backend in backends:  # warm-up: buffers, first-touch page faults, kernel build (or JIT)
        backend.prepare_metadata(md)
        backend.forward(query, new_kv, new_kv, kv_cache, md, scale)
    best = [float("inf")] * len(backends)
    for _ in range(num_iters):
        for i, backend in enumerate(backends):
            sync()
            start = clock()
            backend.forward(query, new_kv, new_kv, kv_cache, md, scale)
            sync()
            best[i] = min(best[i], clock() - start)
    return best


def run_kernels(result: AttentionBenchResult, contexts: list[int], batch_sizes: list[int],
                prefill_shape: tuple[int, int] | None, dtype: torch.dtype, num_iters: int) -> None:
    shape = (result.num_heads, result.num_kv_heads, result.head_dim)
    device = torch.device(result.device)
    backends = [get_attn_backend(name, *shape, dtype, dtype, device, block_size=result.block_size)
                for name in (REFERENCE, result.backend)]
    cases = [("decode", context, batch, 1) for context in contexts for batch in batch_sizes]
    if prefill_shape is not None:
        cases.append(("prefill", prefill_shape[0], 1, prefill_shape[1]))
    for kind, context, batch, query_len in cases:
        query, new_kv, kv_cache, _, md = _step(context, batch, query_len, result.block_size, *shape, dtype,
                                               device=device)
        ref_s, new_s = _time_pair(backends, (query, new_kv, kv_cache, md, result.head_dim ** -0.5), num_iters,
                                  CLOCKS[result.clock], device)
        kv_bytes = 2 * batch * context * result.num_kv_heads * result.head_dim * dtype.itemsize
        bw = result.memory_bandwidth_bytes_per_s
        result.kernels.append(KernelRow(kind, context, batch, query_len, kv_bytes, ref_s * 1e3, new_s * 1e3,
                                        ref_s / new_s, kv_bytes / new_s / bw, kv_bytes / ref_s / bw))
        print(format_kernel_row(result.kernels[-1]), flush=True)
        del query, new_kv, kv_cache, md


def _decode_tok_s(llm: Any, prompts: list[list[int]], output_len: int, clock) -> float:
    from pagedllm import SamplingParams

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = clock()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return clock() - start

    run(1)  # computes (and caches) the long prompts
    # Prompts now hit the prefix cache; the difference of the two runs is output_len decode steps.
    first = min(run(1) for _ in range(2))
    full = min(run(1 + output_len) for _ in range(2))
    return len(prompts) * output_len / max(full - first, 1e-9)


def run_e2e(result: AttentionBenchResult, model: str, context: int, batch_sizes: list[int], output_len: int,
            dtype: str) -> None:
    from pagedllm import LLM
    from pagedllm.config import ModelConfig

    vocab_size = ModelConfig.from_pretrained(model).vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab_size, (context - 16,), generator=gen).tolist()
    tok_s: dict[tuple[str, int], float] = {}
    for name in (REFERENCE, result.backend):
        llm = LLM(model=model, dtype=dtype, device=result.device, attention_backend=name,
                  max_model_len=context + output_len + 1,
                  max_num_seqs=max(batch_sizes), block_size=result.block_size, enable_prefix_caching=True)
        for batch in batch_sizes:
            prompts = [prefix + torch.randint(3, vocab_size, (16,), generator=gen).tolist() for _ in range(batch)]
            tok_s[name, batch] = _decode_tok_s(llm, prompts, output_len, CLOCKS[result.clock])
        del llm
    for batch in batch_sizes:
        ref, new = tok_s[REFERENCE, batch], tok_s[result.backend, batch]
        result.e2e.append(E2ERow(context, batch, ref, new, new / ref))
        print(format_e2e_row(result.e2e[-1], result.backend), flush=True)


def format_kernel_row(r: KernelRow) -> str:
    shape = f"{r.kind} ctx {r.context} x{r.batch}" + (f" q{r.query_len}" if r.query_len > 1 else "")
    return (f"{shape:<28} {r.kv_bytes / 2**20:>9.1f} {r.reference_ms:>10.3f} {r.backend_ms:>10.3f} "
            f"{r.speedup:>7.2f}x {r.reference_bw_fraction:>7.1%} {r.backend_bw_fraction:>7.1%}")


def format_e2e_row(r: E2ERow, backend: str) -> str:
    return (f"{'e2e decode ctx ' + str(r.context) + ' x' + str(r.batch):<28} {r.reference_tok_s:>10.1f} "
            f"{r.backend_tok_s:>10.1f} {r.speedup:>7.2f}x  tok/s ({REFERENCE} vs {backend})")


def format_result(result: AttentionBenchResult) -> str:
    head = (f"attention backend {result.backend} vs {REFERENCE}: heads {result.num_heads}/{result.num_kv_heads}, "
            f"head_dim {result.head_dim}, block {result.block_size}, {result.dtype}, {result.device}, "
            f"{result.num_threads} thread(s), {result.clock} clock, memory bandwidth "
            f"{result.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s (copy)"
            + (f", decode path {result.decode_path}" if result.decode_path else ""))
    cols = (f"{'per layer':<28} {'KV MiB':>9} {'ref ms':>10} {'new ms':>10} {'speedup':>8} "
            f"{'ref BW':>7} {'new BW':>7}")
    lines = [head, cols] + [format_kernel_row(r) for r in result.kernels]
    lines += [format_e2e_row(r, result.backend) for r in result.e2e]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--backend", default=None, choices=[b for b in BACKENDS if b != REFERENCE],
                        help=f"backend compared with {REFERENCE} (default: CPU_FLASH on CPU, TRITON on CUDA)")
    parser.add_argument("--model", default=None, help="model whose attention shape and weights are used "
                        "(default: the bundled demo model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="query and KV dtype (auto: the model's dtype as the engine resolves it here)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=_ints, default=[1024, 8192, 32768])
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 16])
    parser.add_argument("--prefill", type=_ints, default=[8192, 2048],
                        help="CONTEXT,QUERY_LEN of the prefill-chunk row")
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--e2e-context", type=int, default=8192)
    parser.add_argument("--e2e-output-len", type=int, default=16)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=list(CLOCKS),
                        help="wall: elapsed time; cpu: this process's CPU time (for a machine shared with other jobs)")
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="buffer of the bandwidth probe; keep it well above the last-level cache")
    parser.add_argument("--output-json")


def run_cmd(args: argparse.Namespace) -> int:
    from pagedllm.config import ModelConfig, resolve_device

    if args.num_threads is not None:
        if args.num_threads < 1:
            raise SystemExit(f"error: --num-threads must be >= 1, got {args.num_threads}")
        torch.set_num_threads(args.num_threads)
    if len(args.prefill) != 2:
        raise SystemExit(f"error: --prefill takes CONTEXT,QUERY_LEN, got {args.prefill}")
    model = args.model or demo_model_path()
    if model is None:
        raise SystemExit("error: --model is required (the bundled demo model is not installed)")
    device = resolve_device(args.device)
    if device.type == "cuda" and args.clock == "cpu":
        raise SystemExit("error: --clock cpu times this process's CPU, not the GPU's kernels: use --clock wall")
    backend = args.backend or ("CPU_FLASH" if device.type == "cpu" else "TRITON")
    config = ModelConfig.from_pretrained(str(model), args.dtype, device=device)
    dtype = config.dtype
    result = AttentionBenchResult(
        backend=backend, device=str(device), dtype=str(dtype).removeprefix("torch."),
        num_threads=torch.get_num_threads(), clock=args.clock, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, block_size=args.block_size,
        memory_bandwidth_bytes_per_s=measure_memory_bandwidth(args.bandwidth_mib * 2**20, device=device,
                                                              clock=CLOCKS[args.clock]))
    if backend == "CPU_FLASH":
        from pagedllm.attention.cpu_flash import decode_path

        result.decode_path = decode_path()
    print(format_result(result), flush=True)
    run_kernels(result, args.contexts, args.batch_sizes, tuple(args.prefill), dtype, args.num_iters)
    if not args.skip_e2e:
        run_e2e(result, str(model), args.e2e_context, args.batch_sizes, args.e2e_output_len, result.dtype)
    print()
    print(format_result(result))
    write_json(args.output_json, result.to_dict())
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    return run_cmd(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
