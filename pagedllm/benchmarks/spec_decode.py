"""`python -m pagedllm.benchmarks.spec_decode`: speculative decoding at batch 1, measured against plain
decoding in the same run.

Two workloads, both Python code (functions cut from pagedllm's own source, which no demo model saw):
- `code`: a function's first `input_len` tokens; the model continues it.
- `edit`: a code-editing stand-in: the function, then a comment announcing a copy, then the copy's first
  quarter; a model that follows its context repeats most of the prompt's text, which n-gram lookup catches.

Each method (plain, draft model, n-gram), at each k asked for (`-k 2 3 5`), has its own engine on the same
target; requests run one at a time (batch 1), greedy, `ignore_eos`, and the engines take turns prompt by
prompt so background load hits all of them alike, and every row is against the same plain decoding.
Reported per engine: acceptance (vLLM's accepted / drafted, and alpha, the per-token acceptance the seed's
formula uses), tokens per target pass measured against (1 - alpha^(k+1)) / (1 - alpha), decode speed and
its speed-up over plain decoding, and where a speculative step's time goes (target pass vs proposer), with
the speed-up those costs predict: tokens_per_pass * plain_step / (target_pass + propose).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pagedllm
from pagedllm.assets import demo_draft_path, demo_model_path
from pagedllm.benchmarks.reporting import write_json
from pagedllm.spec_decode.spec_decoder import SpecDecodeStats, expected_tokens_per_pass

EDIT_MARKER = "\n\n# An unchanged copy of the code above:\n"


@dataclass
class MethodResult:
    workload: str
    method: str  # plain, draft_model or ngram
    num_speculative_tokens: int
    num_requests: int
    num_output_tokens: int
    e2e_s: float  # summed over requests
    decode_s: float  # first token to last token, summed
    decode_tokens_per_s: float
    speedup: float  # decode tokens/s over plain decoding on the same prompts
    ms_per_step: float  # plain: per decode step; speculative: per target pass (all kinds)
    propose_ms_per_step: float  # speculative: proposer time per step that proposed
    acceptance_rate: float  # accepted / drafted tokens (vLLM's draft acceptance rate)
    alpha: float  # per-token acceptance: accepted / (accepted + rejections)
    tokens_per_pass: float  # measured: 1 + accepted per verified draft
    tokens_per_pass_formula: float  # (1 - alpha^(k+1)) / (1 - alpha)
    predicted_speedup: float  # tokens_per_pass * plain ms_per_step / (ms_per_step + propose_ms_per_step)


def code_snippets(tokenizer: Any, num_prompts: int, input_len: int) -> list[list[int]]:
    """`num_prompts` functions from pagedllm's source, each cut to `input_len` tokens, evenly spread."""
    starts: list[tuple[str, int]] = []
    sources = {}
    for path in sorted(Path(pagedllm.__file__).parent.rglob("*.py")):
        text = path.read_text()
        sources[str(path)] = text
        offset = 0
        for line in text.splitlines(keepends=True):
            if line.lstrip().startswith("def ") and line.startswith(("def ", "    def ")):
                starts.append((str(path), offset))
            offset += len(line)
    candidates = []
    for path, offset in starts:
        ids = tokenizer(sources[path][offset : offset + 12 * input_len], add_special_tokens=False)["input_ids"]
        if len(ids) >= input_len:
            candidates.append(ids[:input_len])
    if len(candidates) < num_prompts:
        raise ValueError(f"only {len(candidates)} functions of {input_len} tokens; lower --input-len")
    step = len(candidates) / num_prompts
    return [candidates[int(i * step)] for i in range(num_prompts)]


def edit_prompts(tokenizer: Any, snippets: list[list[int]]) -> list[list[int]]:
    marker = tokenizer(EDIT_MARKER, add_special_tokens=False)["input_ids"]
    return [ids + marker + ids[: len(ids) // 4] for ids in snippets]


@dataclass
class Engine:
    llm: Any
    method: str  # what the table's method column shows
    k: int       # 0 for plain decoding


def build_engines(args: argparse.Namespace) -> list[Engine]:
    """Plain decoding first, then each method at each k (and its adaptive-k twin with --adaptive)."""
    from pagedllm import LLM

    # Batch 1 needs a small KV pool; the default (max_num_seqs full-length sequences) would take GiBs per engine.
    common = dict(dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len, enable_prefix_caching=False,
                  max_num_seqs=4, num_threads=getattr(args, "num_threads", None))
    engines = [Engine(LLM(model=args.model, **common), "plain", 0)]
    configs = {
        "draft_model": {"method": "draft_model", "model": args.draft_model},
        "ngram": {"method": "ngram", "prompt_lookup_min": args.prompt_lookup_min,
                  "prompt_lookup_max": args.prompt_lookup_max},
    }
    for method in args.methods:
        for k in args.num_speculative_tokens:
            config = dict(configs[method], num_speculative_tokens=k)
            engines.append(Engine(LLM(model=args.model, speculative_config=config, **common), method, k))
            if args.adaptive:
                engines.append(Engine(LLM(model=args.model, speculative_config=dict(
                    config, adaptive_num_speculative_tokens=True), **common), f"{method}+adapt", k))
    return engines


def run_one(llm: Any, prompt: list[int], output_len: int) -> tuple[int, float, float]:
    """(output tokens, end-to-end seconds, decode seconds) for one greedy request alone."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    e2e = time.perf_counter() - start
    m = output.metrics
    decode = (m.last_token_time - m.first_token_time) if m and m.first_token_time and m.last_token_time else e2e
    return len(output.outputs[0].token_ids), e2e, decode


def run_workload(engines: list[Engine], workload: str, prompts: list[list[int]], output_len: int
                 ) -> list[MethodResult]:
    """One row per engine; engines[0] is plain decoding, the baseline of every speed-up."""
    totals = [[0, 0.0, 0.0] for _ in engines]
    stats_before = [copy.deepcopy(e.llm.llm_engine.spec_decoder.stats) if e.k else None for e in engines]
    for prompt in prompts:
        for i, engine in enumerate(engines):  # engines take turns, so background load hits all alike
            tokens, e2e, decode = run_one(engine.llm, prompt, output_len)
            totals[i][0] += tokens
            totals[i][1] += e2e
            totals[i][2] += decode
    plain_tokens, _, plain_decode = totals[0]
    plain_decode_steps = plain_tokens - len(prompts)  # the first token of each request comes from prefill
    plain_ms = 1000 * plain_decode / max(1, plain_decode_steps)
    plain_tps = plain_decode_steps / plain_decode if plain_decode > 0 else float("nan")
    results = []
    for engine, (tokens, e2e, decode), before in zip(engines, totals, stats_before):
        k = engine.k
        tps = (tokens - len(prompts)) / decode if decode > 0 else float("nan")
        result = MethodResult(
            workload=workload,
            method=engine.method,
            num_speculative_tokens=k,
            num_requests=len(prompts),
            num_output_tokens=tokens,
            e2e_s=e2e,
            decode_s=decode,
            decode_tokens_per_s=tps,
            speedup=tps / plain_tps,
            ms_per_step=plain_ms,
            propose_ms_per_step=0.0,
            acceptance_rate=0.0,
            alpha=0.0,
            tokens_per_pass=1.0,
            tokens_per_pass_formula=1.0,
            predicted_speedup=1.0,
        )
        if before is not None:
            st = engine.llm.llm_engine.spec_decoder.stats
            # The stats of this measured run alone: the difference of the counters, read through the
            # same properties the engine's metrics use.
            d = SpecDecodeStats(k, **{f: getattr(st, f) - getattr(before, f) for f in (
                "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                "num_fully_accepted", "num_verify_steps", "num_propose_calls", "verify_execute_s", "propose_s")})
            result.acceptance_rate = d.acceptance_rate
            result.alpha = d.per_token_acceptance
            result.tokens_per_pass = d.mean_tokens_per_pass or 1.0
            result.tokens_per_pass_formula = expected_tokens_per_pass(result.alpha, k)
            result.ms_per_step = 1000 * d.verify_execute_s / max(1, d.num_verify_steps)
            result.propose_ms_per_step = 1000 * d.propose_s / max(1, d.num_propose_calls)
            result.predicted_speedup = (
                result.tokens_per_pass * plain_ms / (result.ms_per_step + result.propose_ms_per_step)
            )
        results.append(result)
    return results


def format_table(results: list[MethodResult]) -> str:
    header = (
        f"{'workload':<8} {'method':<17} {'k':>2} {'accept':>7} {'alpha':>6} {'tok/pass':>8} "
        f"{'formula':>8} {'tok/s':>8} {'speedup':>8} {'target ms':>9} {'propose ms':>10} {'predicted':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.workload:<8} {r.method:<17} {r.num_speculative_tokens:>2} {r.acceptance_rate:>7.3f} "
            f"{r.alpha:>6.3f} {r.tokens_per_pass:>8.2f} {r.tokens_per_pass_formula:>8.2f} "
            f"{r.decode_tokens_per_s:>8.1f} {r.speedup:>7.2f}x {r.ms_per_step:>9.2f} "
            f"{r.propose_ms_per_step:>10.2f} {r.predicted_speedup:>8.2f}x"
        )
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=demo_model_path(), help="target model (default: the demo target)")
    parser.add_argument("--draft-model", default=demo_draft_path(), help="draft model (default: the demo draft)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, nargs="+", default=[5],
                        help="one or more k: each runs as its own engine, all against the same plain decoding")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=["draft_model", "ngram"], choices=["draft_model", "ngram"])
    parser.add_argument("--workloads", nargs="+", default=["code", "edit"], choices=["code", "edit"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adaptive", action="store_true", help="also run each method with adaptive k")
    parser.add_argument("--num-threads", "--threads", dest="num_threads", type=int, default=None,
                        help="torch CPU threads (default: $OMP_NUM_THREADS, else one per physical core)")
    parser.add_argument("--output-json", default=None, help="write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = add_cli_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args(argv)
    return run_spec_decode_cmd(args)


def run_spec_decode_cmd(args: argparse.Namespace) -> int:
    """The whole benchmark from parsed flags (what `pagedllm bench spec-decode` would call)."""
    for flag, path in (("--model", args.model), ("--draft-model", args.draft_model)):
        if ("draft_model" in args.methods or flag == "--model") and not Path(path, "config.json").is_file():
            raise SystemExit(f"{flag}: no model at {path} (train or pass one)")
    if args.num_threads is not None and args.num_threads < 1:
        raise SystemExit(f"--num-threads must be at least 1, got {args.num_threads}")
    if any(k < 1 for k in args.num_speculative_tokens):
        raise SystemExit(f"--num-speculative-tokens must be at least 1, got {args.num_speculative_tokens}")
    engines = build_engines(args)
    tokenizer = engines[0].llm.get_tokenizer()
    snippets = code_snippets(tokenizer, args.num_prompts, args.input_len)
    for engine in engines:  # warm-up: first calls pay one-time costs
        run_one(engine.llm, snippets[0][:32], 8)
    results: list[MethodResult] = []
    for workload in args.workloads:
        prompts = snippets if workload == "code" else edit_prompts(tokenizer, snippets)
        results.extend(run_workload(engines, workload, prompts, args.output_len))
    print(format_table(results))
    print(
        f"batch 1, greedy, {args.num_prompts} prompts of {args.input_len} tokens (edit: "
        f"{statistics.mean(len(p) for p in edit_prompts(tokenizer, snippets)):.0f}), {args.output_len} output "
        f"tokens each; target {args.model}; draft {args.draft_model}"
    )
    # the parsed args hold the subcommand's handler function: write_json writes it as its name
    write_json(args.output_json, {"config": vars(args), "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
