"""`pagedllm quantize MODEL_DIR OUT_DIR --quantization int8|fp8|int4`: a weight-only quantized checkpoint in the
compressed-tensors layout (vLLM reads it too), which `LLM(OUT_DIR)` loads without full-precision weights."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("quantize", help="write a weight-only quantized checkpoint (int8, fp8, int4)",
                                   description=__doc__)
    parser.add_argument("model_dir", help="full-precision Hugging Face model directory")
    parser.add_argument("out_dir", help="where to write the quantized checkpoint")
    parser.add_argument("--quantization", "-q", required=True, choices=["int8", "fp8", "int4"])
    parser.add_argument("--quantization-group-size", "--group-size", type=int, default=None,
                        help="int8: one scale per this many input channels instead of per row; int4 (W4A16, "
                             "asymmetric with zero points): the group size, 32, 64, 128 (default) or 256")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.layers.quantization import QuantizationConfig
    from pagedllm.layers.quantization.compressed_tensors import quantize_checkpoint

    try:
        config = QuantizationConfig(args.quantization, args.quantization_group_size)
        report = quantize_checkpoint(args.model_dir, args.out_dir, config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    before, after = report["quantized_input_bytes"] / 2**20, report["output_bytes"] / 2**20
    print(f"{args.out_dir}: {report['num_quantized']} linear weights as {args.quantization} "
          f"({before:.1f} MiB of them -> a checkpoint of {after:.1f} MiB)")
    return 0
