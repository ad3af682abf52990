"""`pagedllm bench spec-decode`: speculative decoding against plain decoding of the same requests, in one run.

By default on the real model (SmolLM2-135M-Instruct), bf16, 2 threads, with chat workloads of 16 prompts
each (spec_workloads.py): three where the reply repeats its input (`proofread`, `code-edit`, `extract`)
and open-ended `chat`, each greedy and with seeded sampling. One engine per method (plain, `ngram`,
`suffix`; `draft_model` with --draft-model), all on the same target; requests run one at a time (batch 1),
the engines taking turns prompt by prompt so background load hits all of them alike; then the `mixed`
workload (the four interleaved) is run whole by each engine with --batch-size requests at a time.

Reported per row: whether every output equals plain decoding's token for token; acceptance (vLLM's
accepted / drafted, and alpha, the per-token acceptance of the seed's formula); tokens per verifying target
pass measured beside the formula's (1 - alpha^(k+1)) / (1 - alpha), averaged over the drafts at each one's
k and the alpha measured on drafts of that length (k adapts per request and step); the share of decode
steps that speculated; and the speed-up over plain decoding (batch 1: decode tokens/s, first token to
last, and end to end; batch N: output tokens/s of the whole run). The last lines check the must-show
list against these ratios.

The demo pair's raw-text workloads (`code`, `edit`: functions from this repository's source, continued or
copied) remain: `--model <demo> --draft-model <demo draft> --methods draft_model ngram --workloads code edit`.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pagedllm
from pagedllm.benchmarks.reporting import write_json
from pagedllm.benchmarks.spec_workloads import (
    ALL_WORKLOADS,
    CHAT_WORKLOADS,
    GROUNDED_WORKLOADS,
    build_workload,
    mixed_workload,
)
from pagedllm.spec_decode.spec_decoder import SpecDecodeStats

EDIT_MARKER = "\n\n# An unchanged copy of the code above:\n"
RAW_WORKLOADS = ("code", "edit")
MODES = ("greedy", "seeded")
# The must-show list: input-grounded replies at batch 1, open-ended chat at batch 1 (speculation turns
# itself off), the mixed workload batched, and the formula against the measured tokens per pass.
GROUNDED_MIN_SPEEDUP = 2.0
CHAT_MIN_SPEEDUP = 0.97
BATCHED_MIN_SPEEDUP = 1.0
FORMULA_TOLERANCE = 0.10


@dataclass
class MethodResult:
    workload: str
    mode: str  # greedy or seeded (sampling)
    batch_size: int
    method: str  # plain, draft_model, ngram or suffix
    num_speculative_tokens: int
    num_requests: int
    num_identical: int  # outputs equal to plain decoding's, token for token
    num_output_tokens: int
    e2e_s: float
    decode_s: float  # batch 1: first token to last token, summed over requests; batch N: equals e2e_s
    tokens_per_s: float
    speedup: float  # batch 1: decode tokens/s over plain's; batch N: output tokens/s over plain's
    e2e_speedup: float
    acceptance_rate: float = 0.0  # accepted / drafted tokens (vLLM's draft acceptance rate)
    alpha: float = 0.0  # per-token acceptance: accepted / (accepted + rejections)
    tokens_per_pass: float = 1.0  # measured: 1 + accepted per verified draft
    tokens_per_pass_formula: float = 1.0  # (1 - alpha^(k+1)) / (1 - alpha) over the drafts, by length
    speculating_steps: float = 0.0  # share of decode steps that verified proposals
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def formula_ratio(self) -> float:
        return self.tokens_per_pass / self.tokens_per_pass_formula if self.tokens_per_pass_formula else 1.0


@dataclass
class Engine:
    llm: Any
    method: str  # what the table's method column shows
    k: int       # 0 for plain decoding


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


def chat_prompts(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Token ids of each conversation through the tokenizer's chat template, ready for the reply."""
    from pagedllm.llm import render_chat_text

    return [list(tokenizer(render_chat_text(tokenizer, c), add_special_tokens=False)["input_ids"])
            for c in conversations]


def workload_prompts(name: str, tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    if name in RAW_WORKLOADS:
        snippets = code_snippets(tokenizer, args.num_prompts, args.input_len)
        return snippets if name == "code" else edit_prompts(tokenizer, snippets)
    if name == "mixed":
        return chat_prompts(tokenizer, mixed_workload(args.num_prompts, args.seed))
    return chat_prompts(tokenizer, build_workload(name, args.num_prompts, args.seed))


def sampling_params(mode: str, output_len: int, index: int, ignore_eos: bool) -> Any:
    from pagedllm import SamplingParams

    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos, detokenize=False)
    return SamplingParams(temperature=0.7, top_p=0.9, seed=1000 + index, max_tokens=output_len,
                          ignore_eos=ignore_eos, detokenize=False)


def build_engines(args: argparse.Namespace) -> list[Engine]:
    """Plain decoding first, then each method at each k."""
    from pagedllm import LLM

    # max_num_seqs sizes the KV pool for the batch asked for (the default would be far larger). A token
    # budget that holds every admitted prompt whole: where a prompt is cut into chunks depends on how
    # many tokens the running requests take that step (proposals included), and a chunk boundary moves
    # the last bits of the prompt's attention, which in bf16 can flip a near-tied first token; whole
    # prompts keep the comparison with plain decoding exact.
    max_num_seqs = max(args.batch_size, 1)
    common = dict(dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len, enable_prefix_caching=False,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs * args.max_model_len,
                  num_threads=args.num_threads)
    engines = [Engine(LLM(model=args.model, **common), "plain", 0)]
    configs = {
        "draft_model": {"method": "draft_model", "model": args.draft_model},
        "ngram": {"method": "ngram", "prompt_lookup_min": args.prompt_lookup_min,
                  "prompt_lookup_max": args.prompt_lookup_max},
        "suffix": {"method": "suffix"},
    }
    for method in args.methods:
        for k in args.num_speculative_tokens:
            config = dict(configs[method], num_speculative_tokens=k)
            if args.fixed_k:
                config["adaptive_num_speculative_tokens"] = False
            engines.append(Engine(LLM(model=args.model, speculative_config=config, **common), method, k))
    return engines


def stats_of(engine: Engine) -> SpecDecodeStats | None:
    return copy.deepcopy(engine.llm.llm_engine.spec_decoder.stats) if engine.k else None


def stats_delta(engine: Engine, before: SpecDecodeStats) -> SpecDecodeStats:
    """The counters of one measured block alone, as a SpecDecodeStats (its properties do the arithmetic)."""
    st = engine.llm.llm_engine.spec_decoder.stats
    delta = SpecDecodeStats(engine.k, **{f: getattr(st, f) - getattr(before, f) for f in (
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_fully_accepted",
        "num_steps", "num_verify_steps")})
    for name in ("drafted_per_pos", "accepted_per_pos", "drafts_by_len", "accepted_by_len", "fully_accepted_by_len"):
        setattr(delta, name, [a - b for a, b in zip(getattr(st, name), getattr(before, name))])
    return delta


def run_requests(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[list[list[int]], float, float]:
    """(output token ids, end-to-end seconds, decode seconds: first token to last, summed over requests)."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    e2e = time.perf_counter() - start
    decode = 0.0
    for output in outputs:
        m = output.metrics
        decode += (m.last_token_time - m.first_token_time) if m and m.first_token_time and m.last_token_time else 0.0
    return [list(o.outputs[0].token_ids) for o in outputs], e2e, decode


def run_block(engines: list[Engine], workload: str, mode: str, prompts: list[list[int]], args: argparse.Namespace,
              batch_size: int) -> list[MethodResult]:
    """One row per engine; engines[0] is plain decoding, the baseline of every ratio. At batch 1 the
    engines take turns prompt by prompt; batched, each runs the whole workload in turn."""
    params = [sampling_params(mode, args.output_len, i, args.ignore_eos) for i in range(len(prompts))]
    outputs: list[list[list[int]]] = [[] for _ in engines]
    totals = [[0.0, 0.0] for _ in engines]
    before = [stats_of(e) for e in engines]
    groups = [[i] for i in range(len(prompts))] if batch_size == 1 else [list(range(len(prompts)))]
    for group in groups:
        for e, engine in enumerate(engines):
            tokens, e2e, decode = run_requests(engine.llm, [prompts[i] for i in group], [params[i] for i in group])
            outputs[e].extend(tokens)
            totals[e][0] += e2e
            totals[e][1] += decode
    results = []
    for engine, out, (e2e, decode), prior in zip(engines, outputs, totals, before):
        num_tokens = sum(len(t) for t in out)
        # batch 1: decode speed (the first token of each request comes from its prefill); batched: throughput
        timed_tokens, timed_s = (num_tokens - len(prompts), decode) if batch_size == 1 else (num_tokens, e2e)
        result = MethodResult(
            workload=workload, mode=mode, batch_size=batch_size, method=engine.method,
            num_speculative_tokens=engine.k, num_requests=len(prompts),
            num_identical=sum(a == b for a, b in zip(out, outputs[0])), num_output_tokens=num_tokens,
            e2e_s=e2e, decode_s=timed_s, tokens_per_s=timed_tokens / timed_s if timed_s > 0 else float("nan"),
            speedup=1.0, e2e_speedup=1.0, output_token_ids=out)
        if prior is not None:
            d = stats_delta(engine, prior)
            result.acceptance_rate = d.acceptance_rate
            result.alpha = d.per_token_acceptance
            result.tokens_per_pass = d.mean_tokens_per_pass or 1.0
            result.tokens_per_pass_formula = d.expected_tokens_per_pass() or 1.0
            result.speculating_steps = d.num_verify_steps / d.num_steps if d.num_steps else 0.0
        results.append(result)
    for r in results:
        r.speedup = r.tokens_per_s / results[0].tokens_per_s
        r.e2e_speedup = results[0].e2e_s / r.e2e_s if r.e2e_s > 0 else float("nan")
    return results


def format_table(results: list[MethodResult]) -> str:
    header = (f"{'workload':<9} {'mode':<6} {'bs':>2} {'method':<11} {'k':>2} {'same':>5} {'accept':>6} "
              f"{'alpha':>5} {'tok/pass':>8} {'formula':>7} {'ratio':>5} {'spec%':>5} {'tok/s':>7} "
              f"{'speedup':>7} {'e2e':>6}")
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.workload:<9} {r.mode:<6} {r.batch_size:>2} {r.method:<11} {r.num_speculative_tokens:>2} "
            f"{r.num_identical:>2}/{r.num_requests:<2} {r.acceptance_rate:>6.3f} {r.alpha:>5.2f} "
            f"{r.tokens_per_pass:>8.2f} {r.tokens_per_pass_formula:>7.2f} {r.formula_ratio:>5.2f} "
            f"{100 * r.speculating_steps:>4.0f}% {r.tokens_per_s:>7.1f} {r.speedup:>6.2f}x {r.e2e_speedup:>5.2f}x")
    return "\n".join(lines)


def must_show(results: list[MethodResult]) -> list[tuple[str, bool]]:
    """The issue's must-show list, each as (line, holds)."""
    checks: list[tuple[str, bool]] = []
    spec = [r for r in results if r.method != "plain"]
    for r in spec:
        checks.append((f"identical to plain: {r.workload} {r.mode} bs{r.batch_size} {r.method} "
                       f"{r.num_identical}/{r.num_requests}", r.num_identical == r.num_requests))
    for workload in GROUNDED_WORKLOADS:
        for mode in MODES:
            rows = [r for r in spec if r.workload == workload and r.mode == mode and r.batch_size == 1
                    and r.method in ("ngram", "suffix")]
            if rows:
                best = max(rows, key=lambda r: r.speedup)
                checks.append((f"{workload} {mode} batch 1: {best.speedup:.2f}x ({best.method}) >= "
                               f"{GROUNDED_MIN_SPEEDUP}x", best.speedup >= GROUNDED_MIN_SPEEDUP))
    for r in spec:
        if r.workload == "chat" and r.batch_size == 1:
            checks.append((f"chat {r.mode} batch 1 {r.method}: {r.speedup:.2f}x >= {CHAT_MIN_SPEEDUP}x",
                           r.speedup >= CHAT_MIN_SPEEDUP))
        if r.workload == "mixed" and r.batch_size > 1:
            checks.append((f"mixed {r.mode} batch {r.batch_size} {r.method}: {r.speedup:.2f}x >= "
                           f"{BATCHED_MIN_SPEEDUP}x", r.speedup >= BATCHED_MIN_SPEEDUP))
    for r in spec:
        if r.tokens_per_pass_formula > 1.0:
            checks.append((f"tokens per pass vs formula: {r.workload} {r.mode} bs{r.batch_size} {r.method} "
                           f"{r.tokens_per_pass:.2f} / {r.tokens_per_pass_formula:.2f} = {r.formula_ratio:.2f}",
                           abs(r.formula_ratio - 1) <= FORMULA_TOLERANCE))
    return checks


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="target model (default: the real default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--draft-model", default=None, help="draft model, for --methods draft_model")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, nargs="+", default=[8],
                        help="one or more k (the most per step; adaptive k uses fewer where they do not pay): "
                             "each runs as its own engine, all against the same plain decoding")
    parser.add_argument("--fixed-k", action="store_true", help="turn adaptive k off (vLLM's fixed k)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"],
                        choices=["draft_model", "ngram", "suffix"])
    parser.add_argument("--workloads", nargs="+", default=list(CHAT_WORKLOADS),
                        choices=list(ALL_WORKLOADS) + list(RAW_WORKLOADS),
                        help="run at batch 1, each in every --modes")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="greedy, and seeded sampling (temperature 0.7, top-p 0.9, a seed per request)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="requests at a time for the mixed workload (0: skip it)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=192, help="prompt tokens of the raw workloads")
    parser.add_argument("--output-len", type=int, default=192, help="the most tokens per reply")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", "--threads", dest="num_threads", type=int, default=2,
                        help="torch CPU threads")
    parser.add_argument("--output-json", default=None, help="write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = add_cli_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args(argv)
    return run_spec_decode_cmd(args)


def run_spec_decode_cmd(args: argparse.Namespace) -> int:
    """The whole benchmark from parsed flags (what `pagedllm bench spec-decode` calls)."""
    if args.model is None:
        from pagedllm.assets import default_model_path

        args.model = default_model_path()
    if "draft_model" in args.methods and not (args.draft_model and Path(args.draft_model, "config.json").is_file()):
        raise SystemExit(f"--draft-model: no model at {args.draft_model} (needed by --methods draft_model)")
    for flag, value, low in (("--num-threads", args.num_threads, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--output-len", args.output_len, 1), ("--batch-size", args.batch_size, 0)):
        if value is not None and value < low:
            raise SystemExit(f"{flag} must be at least {low}, got {value}")
    if any(k < 1 for k in args.num_speculative_tokens):
        raise SystemExit(f"--num-speculative-tokens must be at least 1, got {args.num_speculative_tokens}")
    engines = build_engines(args)
    tokenizer = engines[0].llm.get_tokenizer()
    warm = workload_prompts(args.workloads[0], tokenizer, args)[0][:32]
    for engine in engines:  # warm-up: first calls pay one-time costs
        run_requests(engine.llm, [warm], [sampling_params("greedy", 8, 0, True)])
    blocks = [(workload, 1) for workload in args.workloads]
    if args.batch_size > 1 and tokenizer.chat_template:
        blocks.append(("mixed", args.batch_size))
    prompts = {workload: workload_prompts(workload, tokenizer, args) for workload, _ in blocks}
    for workload, workload_prompt_ids in prompts.items():
        longest = max(len(p) for p in workload_prompt_ids)
        if longest + args.output_len > args.max_model_len:
            raise SystemExit(f"--max-model-len {args.max_model_len} is too small: a {workload} prompt has {longest} "
                             f"tokens, plus --output-len {args.output_len}")
    results: list[MethodResult] = []
    for workload, batch_size in blocks:
        for mode in args.modes:
            results.extend(run_block(engines, workload, mode, prompts[workload], args, batch_size=batch_size))
    print(format_table(results))
    print(f"{args.num_prompts} prompts per workload, at most {args.output_len} output tokens each; "
          f"{args.dtype}, {args.num_threads} threads; model {args.model}. speedup: batch 1, decode tokens/s "
          "(first token to last) over plain decoding's; batched, output tokens/s of the whole run. e2e: "
          "end-to-end time, plain's over the method's. spec%: decode steps that verified proposals.")
    checks = must_show(results)
    print("\nmust-show:")
    for line, holds in checks:
        print(f"  [{'ok' if holds else 'NO'}] {line}")
    report = [{k: v for k, v in asdict(r).items() if k != "output_token_ids"} | {"formula_ratio": r.formula_ratio}
              for r in results]
    # the parsed args hold the subcommand's handler function: write_json writes it as its name
    write_json(args.output_json, {"config": vars(args), "results": report,
                                  "must_show": [{"check": line, "holds": holds} for line, holds in checks]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
