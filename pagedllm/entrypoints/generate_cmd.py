"""`pagedllm generate`: complete prompts offline with the engine (the default model when none is given)."""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from typing import Any

from pagedllm.assets import installed_model_path
from pagedllm.engine.arg_utils import EngineArgs

DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]

# flag dest -> SamplingParams field, for the flags whose default comes from the model's generation config
_SAMPLING_FLAGS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty"}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "Unset flags take the model's generation_config.json (see --generation-config), else "
                    "SamplingParams' defaults; for the default SmolLM2 model: greedy, 512 tokens (the "
                    "bundled demo model: 128).")
    add = group.add_argument
    add("--max-tokens", type=int, default=None, help="tokens to generate (default: the model's max_new_tokens, "
                                                     "else 16)")
    add("--temperature", type=float, default=None,
        help="0 is greedy (default: 0 if the model's do_sample is false, else its temperature, else 1.0)")
    add("--top-p", type=float, default=None, help="(default: the model's, else 1.0)")
    add("--top-k", type=int, default=None, help="0 disables (default: the model's, else 0)")
    add("--min-p", type=float, default=None, help="(default: the model's, else 0.0)")
    add("--repetition-penalty", type=float, default=None, help="(default: the model's, else 1.0)")
    add("--n", type=int, default=1, help="samples per prompt")
    add("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    add("--stop", action="append", default=None, help="stop string (repeatable)")
    add("--presence-penalty", type=float, default=0.0)
    add("--frequency-penalty", type=float, default=0.0)
    add("--min-tokens", type=int, default=0)
    add("--ignore-eos", action="store_true")
    add("--logprobs", type=int, default=None, metavar="N",
        help="also print each generated token's log-probability and the top N alternatives")


def sampling_params_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None):
    """SamplingParams from the flags: explicit flags win, then `defaults` (the model's generation config),
    then SamplingParams' own defaults."""
    from pagedllm.sampling_params import SamplingParams

    chosen = dict(defaults or {})
    chosen |= {field: getattr(args, dest) for dest, field in _SAMPLING_FLAGS.items()
               if getattr(args, dest) is not None}
    return SamplingParams(
        n=args.n, seed=args.sampling_seed, stop=args.stop, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
        logprobs=args.logprobs, **chosen)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline",
                                   description="Complete prompts with the engine and print the completions.")
    parser.add_argument("prompts", nargs="*", help="prompts, taken literally (default: three short openings)")
    parser.add_argument("--model", default=None, help="local Hugging Face model dir or .gguf file (default: "
                                                      "SmolLM2-135M-Instruct, fetched once; offline, the bundled "
                                                      "demo model)")
    parser.add_argument("--interpret-escapes", action="store_true",
                        help="turn backslash escapes in the prompts (\\n, \\t, \\\\) into the characters")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    parser.set_defaults(func=run)


def interpret_escapes(prompt: str) -> str:
    # escape_decode works on bytes, so non-ASCII text ('café') passes through unharmed, unlike
    # str.encode().decode("unicode_escape"), which would read its UTF-8 bytes as Latin-1
    return codecs.escape_decode(prompt.encode())[0].decode()


def run(args: argparse.Namespace) -> int:
    import json

    from pagedllm.llm import LLM

    model = args.model or installed_model_path()
    if model is None:
        raise ValueError("no --model given and no default model is available")
    engine_args = EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "model": model}))
    llm = LLM(**vars(engine_args))
    params = sampling_params_from_args(args, llm.llm_engine.model_config.get_diff_sampling_param())
    prompts = list(args.prompts) or DEFAULT_PROMPTS
    if args.interpret_escapes:
        prompts = [interpret_escapes(prompt) for prompt in prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    num_generated = 0
    for output in outputs:
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            logprobs = _logprob_rows(llm, completion, args.logprobs) if args.logprobs is not None else None
            if args.json:
                record = {"prompt": output.prompt, "index": completion.index, "text": completion.text,
                          "finish_reason": completion.finish_reason, "num_tokens": len(completion.token_ids)}
                if logprobs is not None:
                    record["logprobs"] = logprobs
                print(json.dumps(record, ensure_ascii=False))
                continue
            print(f"--- prompt: {output.prompt!r} (sample {completion.index}, "
                  f"{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})")
            print(output.prompt + completion.text)
            for row in logprobs or ():
                top = ", ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in row["top_logprobs"])
                print(f"    {row['token']!r:>16} {row['logprob']:8.3f}   top: {top}")
    if not args.json:
        print(f"--- {len(outputs)} prompts, {num_generated} tokens in {elapsed:.2f} s "
              f"({num_generated / max(elapsed, 1e-9):.1f} tokens/s) with {model}", file=sys.stderr)
    return 0


def _logprob_rows(llm: Any, completion: Any, num_top: int) -> list[dict[str, Any]]:
    """Per generated token: its text, log-probability and the top-N alternatives by rank."""
    tokenizer = llm.get_tokenizer()

    def text(token_id: int, logprob: Any) -> str:
        return logprob.decoded_token if logprob.decoded_token is not None else tokenizer.decode([token_id])

    rows = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        chosen = position[token_id]
        # the position holds the chosen token plus the top num_top; the chosen one may rank below them
        top = sorted(((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda item: item[1].rank)
        rows.append({"token": text(token_id, chosen), "logprob": chosen.logprob, "rank": chosen.rank,
                     "top_logprobs": [{"token": text(tid, lp), "logprob": lp.logprob} for tid, lp in top]})
    return rows
