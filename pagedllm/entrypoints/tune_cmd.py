"""`pagedllm tune`: time this CPU's linear kernels on a model's shapes again and cache the table that every
later start reads (layers/linear_tuning.py); a model's first start does the same once by itself."""

from __future__ import annotations

import argparse
import os

from pagedllm.assets import installed_model_path
from pagedllm.engine.arg_utils import EngineArgs


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("tune", help="measure which CPU linear kernel serves a model fastest here",
                                   description=__doc__)
    parser.add_argument("--model", default=None, help="local Hugging Face model dir or .gguf file (default: "
                                                      "the default model)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm import envs
    from pagedllm.layers.linear_tuning import table_key, table_path
    from pagedllm.llm import LLM
    from pagedllm.platform import configure_threads

    model = args.model or installed_model_path()
    if model is None:
        raise ValueError("no --model given and no default model is available")
    if str(envs.value("PAGEDLLM_CPU_PREPACK_WEIGHTS")).strip().lower() not in ("1", "auto"):
        raise ValueError("PAGEDLLM_CPU_PREPACK_WEIGHTS forces a kernel: unset it to tune.")
    if not envs.value("PAGEDLLM_CPU_TUNE"):
        raise ValueError("PAGEDLLM_CPU_TUNE=0 turns tuning off: unset it to tune.")
    threads = configure_threads(args.num_threads)  # the table is per thread count: the engine's own
    path = table_path(table_key(threads))
    if os.path.exists(path):
        os.remove(path)  # measured again, for every model that starts with this key from now on
    engine_args = EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "model": model}))
    llm = LLM(**vars(engine_args))
    model = llm.llm_engine.model_runner.model
    choice = getattr(model, "linear_kernel_choice", None)
    print(choice.describe() if choice is not None else "no full-precision CPU linears to tune (quantized, or not "
                                                       "on the CPU)")
    for quant_choice in getattr(model, "quant_kernel_choices", []):  # weight-only int4 / int8 linears
        print(quant_choice.describe())
    return 0
