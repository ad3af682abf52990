"""`pagedllm plan`: the roofline and KV-capacity arithmetic for a model on a machine, as a table and JSON."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from pagedllm.planner import roofline as rl
from pagedllm.planner.hardware import HARDWARE_PRESETS, HardwareSpec, get_hardware
from pagedllm.planner.presets import MODEL_PRESETS, load_model_spec


@dataclass
class PlanInputs:
    context: int = 8192
    batch: int = 1
    dtype: str = "auto"  # weights; auto = the model's own
    kv_cache_dtype: str = "auto"  # auto = the weights' dtype, as in vLLM
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    acceptance_rate: float = 0.8
    num_speculative_tokens: int = 5
    quantization: str | None = None  # weight-only int8 / fp8 of the linear projections
    # disaggregated prefill: the link between the prefill and the decode machine (None: no such section)
    link_gbs: float | None = None
    prompt_len: int = 4096
    max_num_batched_tokens: int = 2048

    def validate(self) -> None:
        for name in ("context", "batch", "tp", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(f"--acceptance-rate must be in [0, 1], got {self.acceptance_rate}")
        if self.link_gbs is not None and not self.link_gbs > 0:
            raise ValueError(f"--link-gbs must be > 0, got {self.link_gbs}")
        for name in ("prompt_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"--num-speculative-tokens must be >= 0, got {self.num_speculative_tokens}")


def build_plan(spec: rl.ModelSpec, hw: HardwareSpec, inputs: PlanInputs) -> dict[str, Any]:
    """Every number `pagedllm plan` reports, as a JSON-ready dict grouped by topic."""
    inputs.validate()
    weight_dtype = spec.dtype if inputs.dtype == "auto" else inputs.dtype
    # auto follows vLLM: the activations' dtype, which is the weights' unless they are quantized
    auto_kv = weight_dtype if rl.dtype_bytes(weight_dtype) >= 2 else spec.dtype
    kv_dtype = auto_kv if inputs.kv_cache_dtype == "auto" else inputs.kv_cache_dtype
    wb, kb = rl.dtype_bytes(weight_dtype), rl.kv_cache_element_bytes(spec, kv_dtype)
    wb_total = wb
    if inputs.quantization:
        # the projections at 1 byte plus scales; embeddings, LM head and norms stay in the weight dtype
        wb, wb_total = (rl.quantized_weight_dtype_bytes(spec, wb, inputs.quantization, decode=d) for d in (True, False))
    elif inputs.dtype == "auto" and spec.stored_weight_bytes is not None:
        # a GGUF file's block types, kept packed as loaded: the bytes per weight it stores
        held, read = spec.stored_weight_bytes
        assert spec.num_params is not None
        wb, wb_total = read / rl.decode_weight_params(spec, 1), held / spec.num_params
        weight_dtype = f"as stored, {wb_total * 8:.2f} bits a weight"
    ctx, batch, tp = inputs.context, inputs.batch, inputs.tp
    ridge = hw.ridge_point
    cap = rl.capacity(spec, hw.memory_bytes, inputs.gpu_memory_utilization, tp, wb_total, kb, inputs.block_size, ctx)
    decode = rl.decode_bound(spec, ctx, batch, wb, kb, hw.peak_flops, hw.memory_bandwidth, tp)
    decode_1 = rl.decode_bound(spec, ctx, 1, wb, kb, hw.peak_flops, hw.memory_bandwidth, tp)
    tokens_per_pass = rl.speculative_tokens_per_pass(inputs.acceptance_rate, inputs.num_speculative_tokens)
    prefill_tps = rl.prefill_bound_tokens_per_s(spec, ctx, hw.peak_flops, tp)
    plan = {
        "model": {
            "name": spec.name,
            "attention": spec.attention_kind,
            "num_layers": spec.num_layers,
            "num_params": spec.num_params,
            "num_active_params": spec.num_active_params,
            "weight_dtype": weight_dtype,
            "weight_bytes": rl.weight_bytes(spec, wb_total),
            "quantization": inputs.quantization,
        },
        "hardware": {**asdict(hw), "ridge_point_flops_per_byte": ridge},
        "inputs": {**asdict(inputs), "kv_cache_dtype_resolved": kv_dtype},
        "roofline": {
            "ridge_point_flops_per_byte": ridge,
            "decode_intensity_weights_only": rl.decode_intensity(spec, batch, wb),
            "decode_intensity_with_kv": rl.decode_intensity(spec, batch, wb, ctx, kb),
            "compute_bound_batch_weights_only": rl.compute_bound_batch(spec, ridge, wb),
            "compute_bound_batch_with_kv": rl.compute_bound_batch(spec, ridge, wb, ctx, kb),
        },
        "kv_cache": {
            "bytes_per_token": rl.kv_bytes_per_token(spec, kb),
            "bytes_per_token_per_device": cap.kv_bytes_per_token_per_device,
            "bytes_context_x_batch": rl.kv_cache_bytes(spec, kb, ctx, batch),
            # bytes_per_token split into the elements (dtype bytes each: the whole figure with per-tensor
            # scales, as vLLM stores fp8 KV) and the scales of the engine's layout (one-byte dtypes only)
            "element_bytes_per_token": rl.kv_bytes_per_token(spec, rl.dtype_bytes(kv_dtype)),
            "scale_bytes_per_token": rl.kv_scale_bytes_per_token(spec, kv_dtype),
            "element_bytes_context_x_batch": rl.kv_cache_bytes(spec, rl.dtype_bytes(kv_dtype), ctx, batch),
            "scale_bytes_context_x_batch": rl.kv_scale_bytes_per_token(spec, kv_dtype) * ctx * batch,
            # in the run's KV dtype: a float32 run compares float32 variants
            "variants_bytes_per_token": {
                name: {kv_dtype: rl.kv_bytes_per_token(v, kb)} for name, v in rl.kv_variants(spec).items()
            },
            "sliding_window": rl.sliding_window_kv(spec, ctx, inputs.block_size),
        },
        "capacity": {**asdict(cap), "batch_fits": cap.max_sequences >= batch},
        "decode": {
            **asdict(decode),
            "tokens_per_s_per_sequence": decode.tokens_per_s / batch,
            "batch1_tokens_per_s": decode_1.tokens_per_s,
            "bytes_per_token": decode.bytes_per_step / batch,
        },
        "prefill": {
            "tokens_per_s": prefill_tps,
            "time_to_prefill_context_s": ctx / prefill_tps,
            "flops_per_context": rl.prefill_flops(spec, ctx),
        },
        "tensor_parallel": {
            "tensor_parallel_size": tp,
            "all_reduce_bytes_per_token": rl.all_reduce_bytes_per_token(spec, tp, wb),
            "all_reduce_link_bytes_per_token_per_rank": rl.all_reduce_bytes_per_token(spec, tp, wb)
            * 2 * (tp - 1) / tp,
            "logits_gather_bytes_per_sampled_token": rl.logits_gather_bytes_per_token(spec, tp, wb),
        },
        "speculative": {
            "acceptance_rate": inputs.acceptance_rate,
            "num_speculative_tokens": inputs.num_speculative_tokens,
            "tokens_per_target_pass": tokens_per_pass,
            # if drafting were free and verification cost one decode step
            "batch1_tokens_per_s_upper_bound": decode_1.tokens_per_s * tokens_per_pass,
        },
    }
    if inputs.link_gbs is not None:
        plan["disaggregation"] = {"link_bytes_per_s": inputs.link_gbs * 1e9, **asdict(rl.disaggregation(
            spec, inputs.prompt_len, ctx, batch, wb, kb, hw.peak_flops, hw.memory_bandwidth, inputs.link_gbs * 1e9,
            inputs.max_num_batched_tokens, tp))}
    return plan


# --- formatting ----------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def _rate(n: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {prefix}{unit}"
    return f"{n:,.2f} {unit}"


def _sliding_window_rows(window: dict[str, Any] | None, ctx: int) -> list[tuple[str, str]]:
    if window is None:
        return []
    return [(f"sliding window {window['window']:,}",
             f"{window['num_sliding_layers']} layers slide: at {ctx:,} tokens the model needs "
             f"{window['fraction_per_layer_kv']:.1%} of full attention's KV; pagedllm holds "
             f"{window['fraction_engine']:.1%} in {window['num_kv_cache_groups']} KV cache group(s) "
             f"({window['fraction_engine_without_groups']:.1%} with speculative decoding, a KV connector or "
             "a one-byte KV cache, which keep one block table for all layers)")]


def format_plan(plan: dict[str, Any]) -> str:
    m, hw, inp, roof = plan["model"], plan["hardware"], plan["inputs"], plan["roofline"]
    kv, cap, dec, pre, spec = (
        plan["kv_cache"],
        plan["capacity"],
        plan["decode"],
        plan["prefill"],
        plan["speculative"],
    )
    ctx, batch = inp["context"], inp["batch"]
    cb = roof["compute_bound_batch_with_kv"]
    rows: list[tuple[str, str]] = [
        (
            "model",
            f"{m['name']} ({m['attention']}, {m['num_layers']} layers, {_count(m['num_params'])} params"
            + (f", {_count(m['num_active_params'])} active)" if m["num_active_params"] != m["num_params"] else ")"),
        ),
        (
            "hardware",
            f"{hw['name']}: {_rate(hw['peak_flops'], 'FLOP/s')}, {_rate(hw['memory_bandwidth'], 'B/s')}, "
            f"{_bytes(hw['memory_bytes'])} x tp {inp['tp']}",
        ),
        ("dtypes", f"weights {m['weight_dtype']}"
         + (f" ({m['quantization']} linear projections)" if m.get("quantization") else "")
         + f", KV {inp['kv_cache_dtype_resolved']}"),
        ("", ""),
        ("ridge point", f"{roof['ridge_point_flops_per_byte']:,.1f} FLOPs/byte"),
        (
            f"decode intensity, batch {batch}",
            f"{roof['decode_intensity_weights_only']:,.2f} FLOPs/byte (weights only)"
            f", {roof['decode_intensity_with_kv']:,.2f} with KV at {ctx:,} tokens",
        ),
        (
            "compute-bound from batch",
            f"{roof['compute_bound_batch_weights_only']:,.0f} (weights only), "
            + (f"{cb:,.0f} with KV" if cb is not None else f"never with KV at {ctx:,} tokens"),
        ),
        ("", ""),
        (
            "KV per token",
            f"{kv['bytes_per_token']:,.0f} B ({kv['bytes_per_token_per_device']:,.0f} B per device)",
        ),
        (f"KV for {ctx:,} tokens x {batch}", _bytes(kv["bytes_context_x_batch"])),
        *([
            (
                f"  {inp['kv_cache_dtype_resolved']} elements",
                f"{kv['element_bytes_per_token']:,.0f} B per token, {_bytes(kv['element_bytes_context_x_batch'])}"
                " (1 byte each; the whole cache with per-tensor scales, vLLM's fp8 layout)",
            ),
            (
                "  scales",
                f"{kv['scale_bytes_per_token']:,.0f} B per token, {_bytes(kv['scale_bytes_context_x_batch'])}"
                " (pagedllm's layout: a bf16 scale per token and "
                + ("latent" if m["attention"] == "MLA" else "KV head") + ", per-layer scales too)",
            ),
        ] if kv["scale_bytes_per_token"] else []),
        *_sliding_window_rows(kv.get("sliding_window"), ctx),
        ("weights", f"{_bytes(m['weight_bytes'])} ({_bytes(cap['weight_bytes_per_device'])} per device)"),
        (
            "memory left for KV",
            f"{_bytes(cap['kv_memory_bytes_per_device'])} per device"
            + ("" if cap["fits"] else "  (weights do not fit!)"),
        ),
        (
            "fits",
            f"{cap['max_kv_tokens']:,} tokens = {cap['num_blocks']:,} blocks; "
            f"{cap['max_sequences']:,} sequences of {ctx:,} tokens"
            + ("" if cap["batch_fits"] else f"  (batch {batch} does NOT fit)"),
        ),
        (
            "block waste per request",
            f"{cap['block_waste_tokens']} tokens = {_bytes(cap['block_waste_bytes'])} "
            f"(at most block_size - 1 = {inp['block_size'] - 1})",
        ),
        ("", ""),
        (
            f"decode bound, batch {batch}",
            f"{dec['tokens_per_s']:,.1f} tokens/s ({dec['tokens_per_s_per_sequence']:,.1f} "
            f"per sequence, {dec['limited_by']}-bound; {_bytes(dec['bytes_per_step'])} read per step)",
        ),
        ("decode bound, batch 1", f"{dec['batch1_tokens_per_s']:,.1f} tokens/s"),
        (
            f"prefill bound, {ctx:,} tokens",
            f"{pre['tokens_per_s']:,.0f} tokens/s ({pre['time_to_prefill_context_s'] * 1e3:,.1f} ms for the prompt)",
        ),
        (
            "speculative",
            f"{spec['tokens_per_target_pass']:.2f} tokens per target pass (alpha "
            f"{spec['acceptance_rate']}, gamma {spec['num_speculative_tokens']}); batch-1 bound "
            f"{spec['batch1_tokens_per_s_upper_bound']:,.1f} tokens/s",
        ),
    ]
    tpc = plan["tensor_parallel"]
    if tpc["tensor_parallel_size"] > 1:
        rows.append((
            f"all-reduce, TP {tpc['tensor_parallel_size']}",
            f"{tpc['all_reduce_bytes_per_token']:,.0f} B per token (2 per layer + embedding; "
            f"{tpc['all_reduce_link_bytes_per_token_per_rank']:,.0f} B over each rank's link in a ring); "
            f"logits gather {tpc['logits_gather_bytes_per_sampled_token']:,.0f} B per sampled token",
        ))
    if batch == 1:  # the batch row already says it
        rows = [
            row
            for row in rows
            if not (
                row[0] == "decode bound, batch 1"
                and row[1].startswith(f"{dec['batch1_tokens_per_s']:,.1f} tokens/s")
                and "per sequence" not in row[1]
            )
        ]
    if "disaggregation" in plan:
        d = plan["disaggregation"]
        ms = 1e3
        rows += [
            ("", ""),
            ("disaggregation", f"a {d['prompt_len']:,}-token prompt joins {batch} decodes; link "
             f"{_rate(d['link_bytes_per_s'], 'B/s')}"),
            ("  prompt KV, transfer", f"{_bytes(d['kv_bytes'])}, {d['transfer_s'] * ms:,.2f} ms over the link"),
            ("  colocated", f"ITL {d['colocated_itl_s'] * ms:,.2f} ms for {d['colocated_stalled_steps']} steps "
             f"(decode step {d['decode_step_s'] * ms:,.2f} ms + a prefill chunk), "
             f"TTFT {d['colocated_ttft_s'] * ms:,.1f} ms"),
            ("  disaggregated", f"ITL {d['disaggregated_itl_s'] * ms:,.2f} ms, "
             f"TTFT {d['disaggregated_ttft_s'] * ms:,.1f} ms (prefill {d['prefill_s'] * ms:,.1f} + transfer + "
             "one decode step)"),
        ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" if k else "" for k, v in rows]
    lines.append("")
    kv_dtype = inp["kv_cache_dtype_resolved"]
    lines.append(
        f"KV bytes per token by attention variant ({kv_dtype}):  "
        + ", ".join(f"{name} {v[kv_dtype]:,.0f}" for name, v in kv["variants_bytes_per_token"].items())
    )
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    """argparse type of a hardware override: a positive number (0 or less would print nonsense bounds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="roofline and KV-capacity planner",
        description="Roofline and KV-cache capacity arithmetic for a model on a machine. "
        f"Model presets: {', '.join(MODEL_PRESETS)}. Hardware presets: cpu (measured now), "
        f"{', '.join(HARDWARE_PRESETS)}.",
    )
    parser.add_argument("--model", default="llama-3.1-8b", help="preset name, or a directory with config.json")
    parser.add_argument("--hardware", default="h100-sxm", help="preset name, or cpu to measure this machine")
    parser.add_argument("--context", type=int, default=PlanInputs.context, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=PlanInputs.batch, help="concurrent sequences")
    parser.add_argument("--dtype", default="auto", help="weight dtype (auto = the model's)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (= activation dtype), bfloat16, fp8, ...")
    parser.add_argument("--quantization", choices=["int8", "fp8", "int4"], default=None,
                        help="weight-only quantization of the linear projections (embeddings and LM head stay "
                        "in --dtype)")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=PlanInputs.gpu_memory_utilization)
    parser.add_argument("--block-size", type=int, default=PlanInputs.block_size)
    parser.add_argument("--acceptance-rate", type=float, default=PlanInputs.acceptance_rate)
    parser.add_argument("--num-speculative-tokens", type=int, default=PlanInputs.num_speculative_tokens)
    parser.add_argument("--peak-tflops", type=_positive_float, help="override the hardware's dense 16-bit TFLOP/s")
    parser.add_argument("--bandwidth-gbs", type=_positive_float,
                        help="override the hardware's memory bandwidth (GB/s)")
    parser.add_argument("--memory-gb", type=_positive_float, help="override the hardware's memory per device (GB)")
    parser.add_argument("--num-threads", type=int, help="torch threads for measuring --hardware cpu")
    parser.add_argument("--link-gbs", type=float, default=None,
                        help="disaggregated prefill: GB/s of the link between a prefill and a decode machine "
                        "(adds a section comparing it with colocated chunked prefill)")
    parser.add_argument("--prompt-len", type=int, default=PlanInputs.prompt_len,
                        help="with --link-gbs: the long prompt that joins the running decodes")
    parser.add_argument("--max-num-batched-tokens", type=int, default=PlanInputs.max_num_batched_tokens,
                        help="with --link-gbs: the colocated engine's prefill chunk")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--output-json", help="also write the JSON to this file")
    parser.add_argument("--plot", help="draw KV memory against context length into this PNG")
    parser.set_defaults(func=run_plan)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    import dataclasses

    try:
        spec = load_model_spec(args.model)
        weight_dtype = spec.dtype if args.dtype == "auto" else args.dtype
        rl.dtype_bytes(weight_dtype)
        if args.kv_cache_dtype != "auto":
            rl.dtype_bytes(args.kv_cache_dtype)
        if args.num_threads is not None:
            if args.num_threads < 1:
                raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
            import torch

            torch.set_num_threads(args.num_threads)
        hw = get_hardware(args.hardware, weight_dtype)
        inputs = PlanInputs(
            context=args.context,
            batch=args.batch,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            tp=args.tp,
            gpu_memory_utilization=args.gpu_memory_utilization,
            block_size=args.block_size,
            acceptance_rate=args.acceptance_rate,
            num_speculative_tokens=args.num_speculative_tokens,
            quantization=args.quantization,
            link_gbs=args.link_gbs,
            prompt_len=args.prompt_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        inputs.validate()
        if args.quantization:
            rl.linear_weight_params(spec)  # refuses the model shapes it cannot size
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    overrides = {
        k: v
        for k, v in (
            ("peak_flops", args.peak_tflops and args.peak_tflops * 1e12),
            ("memory_bandwidth", args.bandwidth_gbs and args.bandwidth_gbs * 1e9),
            ("memory_bytes", args.memory_gb and args.memory_gb * 1e9),
        )
        if v
    }
    if overrides:
        hw = dataclasses.replace(hw, **overrides)
    plan = build_plan(spec, hw, inputs)
    text = json.dumps(plan, indent=2)
    print(text if args.json else format_plan(plan))
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    if args.plot:
        from pagedllm.planner.plot import plot_kv_memory

        cap = plan["capacity"]
        path = plot_kv_memory(
            spec,
            inputs.batch,
            args.plot,
            max_context=max(131072, inputs.context),
            kv_memory_bytes=cap["kv_memory_bytes_per_device"] * inputs.tp,
            kv_dtype=plan["inputs"]["kv_cache_dtype_resolved"],
            context=inputs.context,
            weight_bytes=cap["weight_bytes_per_device"] * inputs.tp,
            memory_bytes=cap["usable_bytes_per_device"] * inputs.tp,
        )
        if not args.json:
            print(f"\nplot written to {path}")
    return 0
