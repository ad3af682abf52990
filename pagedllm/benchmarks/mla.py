"""`pagedllm bench mla`: multi-head latent attention, absorbed decode against expanded decode, and its
KV bytes per token against an MHA model of the same hidden size.

The model is DeepSeek-V2-Lite's attention shape (hidden 2048, 16 heads, kv_lora_rank 512, rope 64,
nope 128, v 128, no q_lora) with random weights and a dense MLP, `--num-layers` deep. Each context
length gets a latent cache filled with random entries (decode cost does not depend on their values);
then `--batch` sequences decode one token per step through the full model, absorbed and expanded
taking turns step by step so that background load on a shared machine hits both alike. With one torch
thread a step is timed by the thread's CPU time (wall time on a shared box mostly measures waiting;
the JSON keeps both), with more threads by wall time.

KV bytes per token come from the engine (ModelConfig.kv_bytes_per_token, what sizes the pool and the
start-up log prints) and from `pagedllm plan` (build_plan), for MLA and for a Llama-style MHA model of
the same hidden size and heads (head_dim 128).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.platform import cpu_has_native

HIDDEN, HEADS = 2048, 16
MLA_SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)


def _hf_config(arch: str, num_layers: int, dtype: str) -> dict[str, Any]:
    common = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  num_hidden_layers=num_layers, intermediate_size=1408, vocab_size=1024,
                  max_position_embeddings=16384, rms_norm_eps=1e-6,
                  hidden_act="silu", dtype=dtype, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "mla":
        return {**common, **MLA_SHAPE, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "n_routed_experts": 0, "head_dim": MLA_SHAPE["qk_rope_head_dim"]}
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": HIDDEN // HEADS}


def _model_config(hf: dict[str, Any], workdir: Path, dtype: str, max_model_len: int) -> ModelConfig:
    model_dir = workdir / hf["model_type"]
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf))
    return ModelConfig.from_pretrained(str(model_dir), dtype=dtype, max_model_len=max_model_len)


def _random_model(config: ModelConfig) -> torch.nn.Module:
    from pagedllm.models.deepseek import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM(config, backend=None)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model.eval()


def _decode_metadata(batch: int, context: int, block_size: int, dtype: torch.dtype
                     ) -> tuple[AttentionMetadata, torch.Tensor]:
    """`batch` sequences, each `context` tokens long after this step, in disjoint blocks."""
    blocks_per_seq = -(-context // block_size)
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    last = context - 1
    slots = tables[:, last // block_size] * block_size + last % block_size
    metadata = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch, num_decodes=batch,
                                 decode_block_tables=tables)
    if batch == 1:
        metadata.decode_seq_len = context
    else:  # every sequence sees all its keys; the mask is what the runner builds for unequal lengths
        metadata.decode_attn_mask = torch.zeros(batch, 1, 1, blocks_per_seq * block_size, dtype=dtype)
    return metadata, torch.full((batch,), last, dtype=torch.long)


@torch.inference_mode()
def bench_decode(config: ModelConfig, contexts: list[int], batch: int, steps: int, block_size: int = 16
                 ) -> list[dict[str, Any]]:
    model = _random_model(config)
    results = []
    for context in contexts:
        num_blocks = batch * -(-context // block_size)
        gen = torch.Generator().manual_seed(1)
        caches = [torch.randn((1, *config.kv_cache_layer_shape(num_blocks, block_size)), generator=gen
                              ).to(config.dtype)[0] for _ in range(config.num_hidden_layers)]
        metadata, positions = _decode_metadata(batch, context, block_size, config.dtype)
        input_ids = torch.randint(0, config.vocab_size, (batch,), generator=gen)
        times: dict[bool, list[float]] = {True: [], False: []}
        wall: dict[bool, list[float]] = {True: [], False: []}
        outputs: dict[bool, torch.Tensor] = {}
        for step in range(steps + 1):  # step 0 warms up both paths
            for absorbed in (True, False):
                model.mla.absorbed_decode = absorbed
                start, start_cpu = time.perf_counter(), time.thread_time()
                outputs[absorbed] = model(input_ids, positions, caches, metadata)
                if step:
                    wall[absorbed].append(time.perf_counter() - start)
                    # With one torch thread all the work is on this thread: its CPU time is the cost,
                    # free of the waits a shared machine adds to wall time.
                    times[absorbed].append(time.thread_time() - start_cpu if torch.get_num_threads() == 1
                                           else wall[absorbed][-1])
        model.mla.absorbed_decode = True
        diff = (outputs[True].float() - outputs[False].float()).norm() / outputs[False].float().norm()
        for absorbed in (True, False):
            step_s = sorted(times[absorbed])[len(times[absorbed]) // 2]  # median
            results.append({"context": context, "batch": batch, "decode": "absorbed" if absorbed else "expanded",
                            "median_step_s": step_s, "tokens_per_s": batch / step_s,
                            "clock": "thread_cpu" if torch.get_num_threads() == 1 else "wall",
                            "median_step_wall_s": sorted(wall[absorbed])[len(wall[absorbed]) // 2],
                            "relative_difference": float(diff)})
    for context in contexts:
        absorbed, expanded = (r for r in results if r["context"] == context)
        absorbed["speedup_over_expanded"] = absorbed["tokens_per_s"] / expanded["tokens_per_s"]
        expanded["speedup_over_expanded"] = 1.0
    return results


def kv_bytes_table(configs: dict[str, ModelConfig], kv_dtype: torch.dtype) -> list[dict[str, Any]]:
    from pagedllm.planner.cli import PlanInputs, build_plan
    from pagedllm.planner.hardware import get_hardware
    from pagedllm.planner.roofline import ModelSpec

    kv_name = str(kv_dtype).removeprefix("torch.")
    rows = []
    for name, config in configs.items():
        spec = ModelSpec.from_hf_config(config.hf_config, name=name)
        plan = build_plan(spec, get_hardware("h200"), PlanInputs(context=8192, kv_cache_dtype=kv_name))
        engine = config.kv_bytes_per_token(kv_dtype)
        rows.append({"model": name, "attention": spec.attention_kind, "kv_dtype": kv_name,
                     "engine_bytes_per_token": engine, "plan_bytes_per_token": plan["kv_cache"]["bytes_per_token"],
                     "tokens_per_gib": 2**30 // engine})
    mha = rows[-1]["engine_bytes_per_token"]
    for row in rows:
        row["tokens_vs_mha"] = mha / row["engine_bytes_per_token"]
    return rows


def format_tables(decode: list[dict[str, Any]], kv: list[dict[str, Any]]) -> str:
    lines = ["context  batch  decode     step ms  tokens/s  vs expanded  rel. diff",
             *(f"{r['context']:>7}  {r['batch']:>5}  {r['decode']:<9}  {r['median_step_s'] * 1e3:>7.1f}  "
               f"{r['tokens_per_s']:>8.1f}  {r['speedup_over_expanded']:>10.2f}x  {r['relative_difference']:.1e}"
               for r in decode),
             "",
             "model      attention  kv dtype  KV B/token (engine)  KV B/token (plan)  tokens/GiB  tokens vs MHA",
             *(f"{r['model']:<9}  {r['attention']:<9}  {r['kv_dtype']:<8}  {r['engine_bytes_per_token']:>19,}  "
               f"{r['plan_bytes_per_token']:>17,.0f}  {r['tokens_per_gib']:>10,}  {r['tokens_vs_mha']:>12.2f}x"
               for r in kv)]
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed decode steps per path and context")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has it natively, else float32")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-json")


def run_cmd(args: argparse.Namespace) -> int:
    for name in ("batch", "steps", "num_layers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.contexts) < 1:
        raise ValueError(f"--contexts must be positive, got {args.contexts}")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if cpu_has_native(torch.bfloat16) else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        configs = {name: _model_config(_hf_config(name, args.num_layers, dtype), Path(tmp), dtype,
                                       max(args.contexts)) for name in ("mla", "mha")}
    decode = bench_decode(configs["mla"], args.contexts, args.batch, args.steps)
    kv = kv_bytes_table(configs, configs["mla"].dtype)
    print(format_tables(decode, kv))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"decode": decode, "kv_bytes_per_token": kv,
                                                      "dtype": dtype, "num_layers": args.num_layers}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.mla", description=__doc__.split("\n")[0])
    add_cli_args(parser)
    return run_cmd(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
