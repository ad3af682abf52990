"""`pagedllm generate`: complete prompts offline with the engine (the bundled demo model by default)."""

from __future__ import annotations

import argparse
import sys
import time

from pagedllm.assets import installed_model_path
from pagedllm.engine.arg_utils import EngineArgs

DEFAULT_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef "]


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    add = group.add_argument
    add("--max-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.0, help="0 is greedy")
    add("--top-p", type=float, default=1.0)
    add("--top-k", type=int, default=0)
    add("--min-p", type=float, default=0.0)
    add("--n", type=int, default=1, help="samples per prompt")
    add("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    add("--stop", action="append", default=None, help="stop string (repeatable)")
    add("--repetition-penalty", type=float, default=1.0)
    add("--presence-penalty", type=float, default=0.0)
    add("--frequency-penalty", type=float, default=0.0)
    add("--min-tokens", type=int, default=0)
    add("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.sampling_seed, stop=args.stop, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens, ignore_eos=args.ignore_eos)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline",
                                   description="Complete prompts with the engine and print the completions.")
    parser.add_argument("prompts", nargs="*", help="prompts (default: three Python snippets)")
    parser.add_argument("--model", default=None, help="local Hugging Face model dir (default: bundled demo model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from pagedllm.llm import LLM

    model = args.model or installed_model_path()
    if model is None:
        print("error: no --model given and the bundled demo model is not installed", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "model": model}))
    try:
        params = sampling_params_from_args(args)
        llm = LLM(**vars(engine_args))
        prompts = [p.encode().decode("unicode_escape") for p in args.prompts] or DEFAULT_PROMPTS
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    num_generated = 0
    for output in outputs:
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            if args.json:
                print(json.dumps({"prompt": output.prompt, "index": completion.index, "text": completion.text,
                                  "finish_reason": completion.finish_reason,
                                  "num_tokens": len(completion.token_ids)}))
            else:
                print(f"--- prompt: {output.prompt!r} (sample {completion.index}, "
                      f"{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})")
                print(output.prompt + completion.text)
    if not args.json:
        print(f"--- {len(outputs)} prompts, {num_generated} tokens in {elapsed:.2f} s "
              f"({num_generated / max(elapsed, 1e-9):.1f} tokens/s) with {model}", file=sys.stderr)
    return 0
