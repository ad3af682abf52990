"""Train pagedllm's bundled demo models: a Python-code target and its distilled draft.

One command, seeded, CPU only:

    python tools/train_demo_models.py                       # full run (hours on one shared core)
    python tools/train_demo_models.py --scale 0.01 --ckpt-dir /tmp/smoke   # smoke run, minutes

Training checkpoints every few minutes into --ckpt-dir (outside the git tree); rerunning the same
command continues from the last checkpoint (model, optimizer, step, RNG and data position), so a
run that is killed loses at most a few minutes. --stop-at HH:MM (UTC) ends a stage early at a
wall-clock time and still exports a model; the learning-rate schedule then decays by whichever
is further along, steps or time, so a cut-short run still ends at a low learning rate.

Stages (each can be re-run alone with --stage, reading what earlier stages saved):
  target  corpus from the running interpreter's stdlib, byte-level BPE tokenizer, target model
  draft   draft model distilled on the target's predictions (KL + next-token loss)
  card    evaluation (validation loss, greedy agreement, samples) and the two model cards

The models are Llama-architecture and saved in Hugging Face format, so transformers loads them as-is.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "pagedllm" / "assets" / "models"
TARGET_NAME = "pycode-target"
DRAFT_NAME = "pycode-draft"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# A code model has no roles; the template only joins the message contents so chat works mechanically.
# The model continues the last message directly, so add_generation_prompt adds nothing.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
)
# Directories skipped in the stdlib: test suites (test/, lib2to3's tests/ with its data fixtures,
# idlelib's idle_test/) make completions drift into test boilerplate, and site-packages is whatever
# happens to be installed, not the stdlib. --include-tests keeps the test suites.
TEST_DIRS = {"test", "tests", "idle_test"}
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# The prompts of the cards' samples and of tests/test_demo_models.py's "does it parse" check.
SAMPLE_PROMPTS = ["def fibonacci(n):", "class Stack:", "def read_lines(path):", "import os\n\ndef ",
                  "def is_prime(n):"]
# A line made only of literals (numbers, hex, short strings), punctuation and comments: the shape of
# codec tables, Unicode/HTML entity tables, locale alias maps, pydoc's topic strings.
LITERAL_LINE = re.compile(
    r"""^\s*(?:[-+]?(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?)|[uUbBrR]?'[^']*'|[uUbBrR]?"[^"]*"|[\s,:()\[\]{}]|#.*$)+$"""
)
DATA_LIKE_FRACTION = 0.5
# On-policy distillation of the draft: prompt windows of the training text and the target's greedy
# continuations of them, about the shape of `pagedllm bench spec-decode`'s requests.
ON_POLICY_PROMPT_LEN = 128
ON_POLICY_MAX_TOKENS = 192
# Greedy tokens per sample: enough for a short function or class to finish its first block.
SAMPLE_MAX_TOKENS = 128


@dataclass
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


# Target: GQA with 8 query / 4 KV heads, so tensor_parallel_size 1, 2 and 4 each get whole KV heads.
TARGET_SHAPE = ModelShape(256, 6, 8, 4, 768)
# Draft: at most a fifth of the target's parameters (most of them its embedding); two layers keep
# its per-step operator count, which is what a decode step costs at this size, low.
DRAFT_SHAPE = ModelShape(128, 2, 8, 4, 256)


@dataclass
class TrainArgs:
    steps: int
    lr: float
    # Small batches of short windows: the compute here buys about ten million tokens, so more
    # optimizer updates per token matter more than long context.
    batch_size: int = 6
    seq_len: int = 256
    warmup: int = 30
    weight_decay: float = 0.1
    # Distillation only: weight of the KL term and the softening temperature.
    distill_alpha: float = 0.0
    distill_temperature: float = 1.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------- corpus


def stdlib_files(include_tests: bool = False) -> list[tuple[str, Path]]:
    """(path relative to the stdlib, absolute path) of every stdlib .py file we may train on, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = SKIP_DIRS if include_tests else SKIP_DIRS | TEST_DIRS
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in skip for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or rel.parts[0].startswith("config-"):
            continue  # build-machine specific, not source
        files.append((rel.as_posix(), path))
    files.sort()
    return files


def is_validation(rel_path: str, seed: int, val_percent: int = 5) -> bool:
    """Seeded split by a hash of the relative path: the same file lands on the same side everywhere."""
    digest = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < val_percent


def is_data_like(text: str) -> bool:
    """Tables, not code, judged by content: at least half of the non-blank lines are literals only.

    That catches the charmap codecs (`encodings/cp1252.py`: 94% such lines), `encodings/aliases.py`,
    `html/entities.py`, `locale.py`'s alias tables (60%) and pydoc's topic strings (99%), while real
    modules stay far below (`_pydecimal.py` 8%). Left in, those tables pull greedy completions into
    `0x00e9: 0x00e9,  # LATIN SMALL LETTER E WITH ACUTE` lines.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    literal = sum(1 for line in lines if LITERAL_LINE.match(line) and any(c.isdigit() or c in "'\"" for c in line))
    return literal >= DATA_LIKE_FRACTION * len(lines)


def load_corpus(seed: int, include_tests: bool = False) -> tuple[list[str], list[str], list[str], dict]:
    """Training and validation documents of the library (one per file), the test suites' documents
    (empty unless include_tests), and what was left out, by reason.

    Test files are kept apart: they only ever join the training stream, so the tokenizer and the
    validation split (library files only) are the same with and without them, and a run can add
    them halfway and resume from its checkpoint.
    """
    train, val, tests = [], [], []
    seen: set[bytes] = set()
    dropped = {"unreadable_or_empty": 0, "data_like": 0, "duplicate": 0}
    # Library files first, so a test file that duplicates one never takes its place in the split.
    for rel, path in sorted(stdlib_files(include_tests), key=lambda f: is_test_file(f[0])):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            dropped["unreadable_or_empty"] += 1
            continue
        if not text.strip():
            dropped["unreadable_or_empty"] += 1
            continue
        if is_data_like(text):
            dropped["data_like"] += 1
            continue
        digest = hashlib.sha256(text.encode()).digest()
        if digest in seen:  # identical copies (vendored files, empty-ish __init__ stubs) count once
            dropped["duplicate"] += 1
            continue
        seen.add(digest)
        if is_test_file(rel):
            tests.append(text)
        else:
            (val if is_validation(rel, seed) else train).append(text)
    return train, val, tests, dropped


def is_test_file(rel_path: str) -> bool:
    return any(part in TEST_DIRS for part in rel_path.split("/")[:-1])


# ------------------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Prompts get BOS prepended, as every training document starts with BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,  # decode must round-trip code exactly
        model_max_length=2048,
    )
    hf_tok.save_pretrained(out_dir)
    finish_tokenizer_config(out_dir)


def finish_tokenizer_config(out_dir: Path) -> None:
    """Make tokenizer_config.json self-describing for older and newer transformers alike.

    transformers 5 writes its own class name (TokenizersBackend) and keeps the chat template in a
    separate chat_template.jinja; PreTrainedTokenizerFast and an inline template load everywhere.
    """
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = True  # documents the post-processor's BOS; the post-processor does the work
    cfg["add_eos_token"] = False
    for key in ("is_local", "local_files_only"):  # load-time state that leaked into the file
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def copy_tokenizer(tok_dir: Path, out_dir: Path) -> None:
    # Each model dir carries its own copy of the tokenizer, so either loads alone.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out_dir / name)
    finish_tokenizer_config(out_dir)


def encode_documents(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream: BOS doc EOS BOS doc EOS ..."""
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):  # post-processor adds the BOS
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------------------- models


def make_config(shape: ModelShape, tok: Tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=2048,  # trained at 256; the engine may serve longer (RoPE extrapolation)
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once


def sample_batch(stream: torch.Tensor, args: TrainArgs, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
    return torch.stack([stream[s : s + args.seq_len + 1] for s in starts.tolist()]).long()


def val_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """Fixed, evenly spaced windows of the validation stream: the same for every model and run."""
    count = min(count, (len(stream) - 1) // (seq_len + 1))
    step = (len(stream) - seq_len - 1) // max(count, 1)
    return torch.stack([stream[i * step : i * step + seq_len + 1] for i in range(count)]).long()


@torch.no_grad()
def eval_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8, bf16: bool = False) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(chunk[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def lr_at(progress: float, step: int, args: TrainArgs) -> float:
    """Linear warmup over the first steps, then cosine decay to a tenth of the peak over progress
    (0 to 1: the larger of steps done and wall time used, see train)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, progress)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(path: Path, state: dict) -> None:
    # Write then rename, so a kill during the write leaves the previous checkpoint intact.
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    val: torch.Tensor,
    args: TrainArgs,
    seed: int,
    ckpt_path: Path,
    teacher: LlamaForCausalLM | None = None,
    bf16: bool = False,
    stop_at: float | None = None,
    compile_step: bool = False,
    ckpt_minutes: float = 3.0,
) -> dict:
    """Train in place, resuming from ckpt_path if it exists; return the run's statistics.

    stop_at (a Unix time) ends training early; the cosine schedule then runs on whichever is further
    along, steps or wall time since the run first started, so the model still ends at a low learning
    rate. The random windows are drawn from a generator whose state is checkpointed, so a resumed run
    sees the same data it would have seen uninterrupted (a run that uses stop_at is not reproducible
    step for step anyway: where it ends depends on the machine's load).
    """
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    step, tokens, seconds, origin, history = 0, 0, 0.0, time.time(), []
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        step, tokens, seconds = state["step"], state["tokens"], state["train_seconds"]
        origin, history = state["time_origin"], state["history"]
        log(f"resumed from {ckpt_path} at step {step} ({tokens / 1e6:.2f}M tokens, {seconds / 60:.1f} min)")

    forward = torch.compile(model) if compile_step else model
    model.train()

    def progress() -> float:
        by_steps = step / max(1, args.steps)
        if stop_at is None:
            return by_steps
        return max(by_steps, (time.time() - origin) / max(1.0, stop_at - origin))

    def checkpoint() -> None:
        vloss = eval_loss(model, val[:8], bf16=bf16)
        history.append({"step": step, "tokens": tokens, "val_loss": round(vloss, 4)})
        log(f"  step {step}: val loss {vloss:.3f} (8 windows); checkpoint {ckpt_path}")
        save_checkpoint(ckpt_path, {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
            "torch_rng": torch.get_rng_state(), "step": step, "tokens": tokens, "train_seconds": seconds,
            "time_origin": origin, "history": history,
        })

    t_start, tokens_start, last_ckpt, last_log = time.time(), tokens, time.time(), 0.0
    stopped_early = False
    while step < args.steps:
        if stop_at is not None and time.time() >= stop_at:
            log(f"stopping at step {step}/{args.steps}: reached --stop-at")
            stopped_early = True
            break
        t_step = time.time()
        lr = lr_at(progress(), step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sample_batch(stream, args, gen)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(inputs).logits.float()
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss = ce
            if teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher(inputs).logits.float()
                temp = args.distill_temperature
                kl = F.kl_div(
                    F.log_softmax(logits.flatten(0, 1) / temp, dim=-1),
                    F.log_softmax(teacher_logits.flatten(0, 1) / temp, dim=-1),
                    log_target=True,
                    reduction="batchmean",
                ) * (temp * temp)
                loss = args.distill_alpha * kl + (1 - args.distill_alpha) * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += inputs.numel()
        seconds += time.time() - t_step
        now = time.time()
        if now - last_log > 60 or step == args.steps:
            rate = (tokens - tokens_start) / max(1e-9, now - t_start)
            log(f"step {step}/{args.steps} loss {loss.item():.3f} ce {ce.item():.3f} lr {lr:.2e} "
                f"{tokens / 1e6:.2f}M tokens, {rate:.0f} tok/s")
            last_log = now
        if now - last_ckpt > ckpt_minutes * 60:
            checkpoint()
            last_ckpt = time.time()
    checkpoint()
    return {
        "train_steps": step,
        "planned_steps": args.steps,
        "stopped_early": stopped_early,
        "train_tokens": tokens,
        "train_seconds": round(seconds, 1),
        "history": history,
    }


def save_model(model: LlamaForCausalLM, tok_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    cfg = model.config
    GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    ).save_pretrained(out_dir)
    copy_tokenizer(tok_dir, out_dir)


# --------------------------------------------------------------------------------------- stages


def prepare_data(a: argparse.Namespace) -> tuple[Path, torch.Tensor, torch.Tensor, dict]:
    """Tokenizer dir, train and validation token streams, corpus statistics; cached in --ckpt-dir
    (and rebuilt when the settings that shape them change)."""
    work = a.ckpt_dir
    tok_dir = work / "tokenizer"
    cache = work / "streams.pt"
    # "seed" is the split's seed (--split-seed; the key is older than the flag, and cached streams keep it)
    settings = {"seed": a.split_seed, "vocab_size": a.vocab_size, "include_tests": a.include_tests,
                "python": sys.version.split()[0]}
    same_tokenizer = False
    if cache.exists() and (tok_dir / "tokenizer.json").exists():
        data = torch.load(cache)
        if data.get("settings") == settings:
            return tok_dir, data["train"], data["val"], data["corpus"]
        # The tokenizer is trained on library files only, so adding or dropping the test suites
        # keeps it (and the checkpoints trained with it) valid; anything else starts over.
        cached = dict(data.get("settings") or {}, include_tests=a.include_tests)
        same_tokenizer = cached == settings
        if not same_tokenizer and (work / "target.pt").exists():
            sys.exit(f"{work} holds a run with other data settings ({data.get('settings')}); use another --ckpt-dir")
    t0 = time.time()
    train_texts, val_texts, test_texts, dropped = load_corpus(a.split_seed, a.include_tests)
    log(f"corpus: {len(train_texts)} train files (+{len(test_texts)} test-suite files), {len(val_texts)} "
        f"validation files, {sum(map(len, train_texts)) / 1e6:.1f}M (+{sum(map(len, test_texts)) / 1e6:.1f}M) / "
        f"{sum(map(len, val_texts)) / 1e6:.2f}M characters; left out {dropped}")
    if same_tokenizer:
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        log(f"kept the tokenizer in {tok_dir} (same library files)")
    elif (init_dir := a.init_target or a.init_draft) is not None:
        # Continuing a saved model needs its own token ids: take its tokenizer, do not retrain one.
        tok = Tokenizer.from_file(str(init_dir / "tokenizer.json"))
        tok_dir.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, tok_dir)
        log(f"tokenizer taken from {init_dir}")
    else:
        tok = train_tokenizer(train_texts, a.vocab_size)
        tok_dir.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, tok_dir)
    train_texts = train_texts + test_texts
    train_stream, val_stream = encode_documents(tok, train_texts), encode_documents(tok, val_texts)
    log(f"tokenizer ({tok.get_vocab_size()} tokens) and streams in {time.time() - t0:.0f} s: "
        f"{len(train_stream) / 1e6:.2f}M train, {len(val_stream) / 1e6:.3f}M validation tokens")
    corpus = {
        "files_train": len(train_texts),
        "files_tests": len(test_texts),
        "files_val": len(val_texts),
        "chars_train": sum(map(len, train_texts)),
        "chars_val": sum(map(len, val_texts)),
        "files_left_out": dropped,
        "include_tests": a.include_tests,
        "split_seed": a.split_seed,
        "tokens_train": len(train_stream),
        "tokens_val": len(val_stream),
    }
    torch.save({"train": train_stream, "val": val_stream, "corpus": corpus, "settings": settings}, cache)
    return tok_dir, train_stream, val_stream, corpus


def stop_time(hhmm: str | None) -> float | None:
    """--stop-at HH:MM (UTC) as a Unix time: today's, or tomorrow's if today's passed over 12 hours ago
    (a rerun shortly after the time stops at once and exports what the checkpoint holds)."""
    if hhmm is None:
        return None
    hour, minute = map(int, hhmm.split(":"))
    now = datetime.now(timezone.utc)
    at = now.replace(hour=hour, minute=minute, second=0, microsecond=0).timestamp()
    return at + 86400 if now.timestamp() - at > 12 * 3600 else at


def init_model(init_dir: Path | None, config: LlamaConfig) -> LlamaForCausalLM:
    """A fresh model, or (--init-target / --init-draft) a saved one to train further in fp32.

    Starting from the bundled weights carries training across sessions whose checkpoint directory
    is gone: the optimizer state starts afresh, the weights (and so the tokens seen) carry over.
    A checkpoint in --ckpt-dir, once written, still takes precedence (train() loads it).
    """
    if init_dir is None:
        return LlamaForCausalLM(config)
    model = LlamaForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    if model_shape_of(model.config) != model_shape_of(config):
        sys.exit(f"{init_dir} has shape {model_shape_of(model.config)}; pass the matching --target-shape/--draft-shape")
    log(f"starting from the weights in {init_dir}")
    return model


TRAIN_STAT_KEYS = ("train_steps", "planned_steps", "stopped_early", "train_tokens", "train_seconds", "history",
                   "args", "command", "machine", "precision", "threads", "on_policy_prompts", "earlier")
# Where the first bundled pair was trained (its cards predate run_conditions).
FIRST_RUNS_MACHINE = {"machine": "2-core AMD EPYC (Zen 4, AVX512-bf16)", "precision": "bf16 autocast", "threads": 1}


def run_conditions(a: argparse.Namespace) -> dict:
    """The machine, precision and threads of this run, for the card."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    units = "AVX512-bf16/AMX" if cpu_has_bf16() else "no bf16 matmul units"
    return {"machine": f"{os.cpu_count()}-core {name} ({units})",
            "precision": "bf16 autocast" if a.bf16 else "fp32", "threads": a.threads}


def earlier_training(init_dir: Path | None, name: str) -> dict | None:
    """What the card of a model we continue from says about its training (None for a fresh model), so
    that the new card counts every token the weights have seen."""
    path = init_dir / "training_results.json" if init_dir is not None else None
    if path is None or not path.exists():
        return None
    results = json.loads(path.read_text())
    earlier = {key: results[name][key] for key in TRAIN_STAT_KEYS if key in results[name]}
    if "command" not in earlier and len(results.get("commands", [])) == 3:
        # a card from before runs kept their own commands: target, draft, card, in that order
        earlier["command"] = results["commands"][0 if name == "target" else 1]
    return earlier


def train_stats(a: argparse.Namespace, name: str, model_dir: Path) -> dict:
    """The stage's statistics from --ckpt-dir, or, for a model not trained there (a pair whose target
    was trained in an earlier session), those on the model's own card."""
    path = a.ckpt_dir / f"{name}_train.json"
    if path.exists():
        return json.loads(path.read_text())
    earlier = earlier_training(model_dir, name)
    if earlier is None:
        sys.exit(f"no {path} and no training_results.json in {model_dir}: run the {name} stage first")
    log(f"{name}: not trained in {a.ckpt_dir}; its training statistics come from {model_dir}")
    return earlier


def training_runs(stats: dict) -> list[dict]:
    """The runs behind a model, oldest first: the earlier runs it continued from, then its own."""
    earlier = stats.get("earlier")
    return (training_runs(earlier) if earlier else []) + [stats]


def total_tokens(stats: dict) -> int:
    """Every training token the weights have seen, earlier runs they continued from included."""
    return sum(run["train_tokens"] for run in training_runs(stats))


def stage_target(a: argparse.Namespace) -> None:
    tok_dir, train_stream, val_stream, _ = prepare_data(a)
    torch.manual_seed(a.seed)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    model = init_model(a.init_target, make_config(a.target_shape, tok))
    log(f"target: {num_params(model) / 1e6:.2f}M parameters")
    args = TrainArgs(steps=1, lr=a.target_lr, warmup=100)
    args.steps = max(1, round(a.target_tokens * a.scale / (args.batch_size * args.seq_len)))
    val = val_windows(val_stream, args.seq_len, 64)
    stats = train(model, train_stream, val, args, a.seed, a.ckpt_dir / "target.pt", bf16=a.bf16,
                  stop_at=stop_time(a.stop_at), compile_step=a.compile)
    save_model(model, tok_dir, a.out / TARGET_NAME)
    stats.update(run_conditions(a), earlier=earlier_training(a.init_target, "target"))
    save_stats(a, "target", {**stats, "args": asdict(args), "command": a.command})


def stage_draft(a: argparse.Namespace) -> None:
    tok_dir, train_stream, val_stream, _ = prepare_data(a)
    teacher = AutoModelForCausalLM.from_pretrained(a.out / TARGET_NAME, dtype=torch.float32).eval()
    teacher.requires_grad_(False)
    torch.manual_seed(a.seed + 1)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    model = init_model(a.init_draft, make_config(a.draft_shape, tok))
    log(f"draft: {num_params(model) / 1e6:.2f}M parameters (target {num_params(teacher) / 1e6:.2f}M)")
    # Mostly KL to the target's distribution: the draft's job is to guess what the target will say.
    args = TrainArgs(steps=1, lr=a.draft_lr, warmup=50, distill_alpha=0.9, distill_temperature=1.0)
    args.steps = max(1, round(a.draft_tokens * a.scale / (args.batch_size * args.seq_len)))
    val = val_windows(val_stream, args.seq_len, 64)
    if a.on_policy_prompts > 0:
        # Speculative decoding asks the draft to guess the target's own continuations, which are
        # not the library's text (a small model's greedy output repeats itself): distil on those too.
        generated = on_policy_stream(a, train_stream)
        train_stream = torch.cat([generated, train_stream[: len(generated)]])
        log(f"draft stream: {len(generated) / 1e6:.2f}M tokens of target continuations + as many of library text")
    stats = train(model, train_stream, val, args, a.seed + 1, a.ckpt_dir / "draft.pt", teacher, bf16=a.bf16,
                  stop_at=stop_time(a.draft_stop_at), compile_step=a.compile)
    save_model(model, tok_dir, a.out / DRAFT_NAME)
    stats.update(run_conditions(a), on_policy_prompts=a.on_policy_prompts,
                 earlier=earlier_training(a.init_draft, "draft"))
    save_stats(a, "draft", {**stats, "args": asdict(args), "command": a.command})


def save_stats(a: argparse.Namespace, name: str, stats: dict) -> None:
    """The stage's statistics, in --ckpt-dir for the card stage and beside the saved weights in the shape of
    a card's training_results.json, so that a run continuing those weights (--init-target / --init-draft)
    counts this one's tokens before any card is written. The card stage replaces the latter."""
    (a.ckpt_dir / f"{name}_train.json").write_text(json.dumps(stats))
    model_dir = a.out / (TARGET_NAME if name == "target" else DRAFT_NAME)
    (model_dir / "training_results.json").write_text(json.dumps({name: stats}, indent=2))


def on_policy_stream(a: argparse.Namespace, train_stream: torch.Tensor) -> torch.Tensor:
    """The target's greedy continuations of random training windows, as one token stream (each
    sequence: its prompt window, then the continuation). Generated by pagedllm's engine in fp32 and
    cached in --ckpt-dir, keyed by the target's weights."""
    target_dir = a.out / TARGET_NAME
    key = hashlib.sha256((target_dir / "model.safetensors").read_bytes()).hexdigest()[:16]
    settings = {"target": key, "prompts": a.on_policy_prompts, "prompt_len": ON_POLICY_PROMPT_LEN,
                "max_tokens": ON_POLICY_MAX_TOKENS, "seed": a.seed}
    cache = a.ckpt_dir / "on_policy.pt"
    if cache.exists():
        data = torch.load(cache)
        if data["settings"] == settings:
            return data["stream"]
    sys.path.insert(0, str(REPO_ROOT))
    from pagedllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(a.seed + 2)
    starts = torch.randint(0, len(train_stream) - ON_POLICY_PROMPT_LEN, (a.on_policy_prompts,), generator=gen)
    prompts = [{"prompt_token_ids": train_stream[s : s + ON_POLICY_PROMPT_LEN].tolist()} for s in starts.tolist()]
    t0 = time.time()
    llm = LLM(model=str(target_dir), dtype="float32", max_num_seqs=64, max_model_len=1024, num_threads=a.threads)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=ON_POLICY_MAX_TOKENS, detokenize=False),
                           use_tqdm=False)
    ids: list[int] = []
    for prompt, out in zip(prompts, outputs):
        ids += prompt["prompt_token_ids"] + list(out.outputs[0].token_ids)
    stream = torch.tensor(ids, dtype=torch.int32)
    log(f"generated {len(outputs)} target continuations ({len(stream) / 1e6:.2f}M tokens) in {time.time() - t0:.0f} s")
    torch.save({"settings": settings, "stream": stream}, cache)
    return stream


@torch.no_grad()
def greedy_agreement(target: torch.nn.Module, draft: torch.nn.Module, windows: torch.Tensor) -> float:
    """Fraction of positions where the draft's argmax equals the target's (teacher-forced on real text)."""
    same, total = 0, 0
    for i in range(0, len(windows), 8):
        chunk = windows[i : i + 8, :-1]
        t = target(chunk).logits.argmax(-1)
        d = draft(chunk).logits.argmax(-1)
        same += (t == d).sum().item()
        total += t.numel()
    return same / total


def first_top_level_block(text: str, prompt: str) -> tuple[str, bool]:
    """The prompt and completion up to the end of the block the prompt opens, and whether that block
    ended before the text did.

    The block starts at the prompt's last line that begins at column 0 (the `def`/`class` header the
    prompt opens; for "import os\\n\\ndef " the `def` line) and ends before the next non-blank
    line that starts at column 0, or at the end of the text. Everything before the block (earlier
    prompt lines such as `import os`) is kept, so the result parses as a module.
    """
    prompt_lines = prompt.split("\n")
    start = max(i for i, line in enumerate(prompt_lines) if line and not line[0].isspace())
    lines = text.split("\n")
    for i in range(start + 1, len(lines)):
        if lines[i].strip() and not lines[i][0].isspace():
            return "\n".join(lines[:i]), True
    return text, False


def block_parses(text: str, prompt: str) -> bool:
    """Whether the first top-level block of prompt + completion is valid Python. A block that runs
    into the end of the text may have its last line cut by the token limit; it also counts if it
    parses without that line (and still has a body)."""
    block, ended = first_top_level_block(text, prompt)
    if parses(block):
        return True
    head, _, _ = block.rpartition("\n")
    return not ended and len(head) > len(prompt) and parses(head)


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def engine_completions(model_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions by pagedllm's engine in fp32, as `pagedllm generate --dtype float32` makes them."""
    sys.path.insert(0, str(REPO_ROOT))
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=len(prompts), max_model_len=1024)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [out.outputs[0].text for out in outputs]


def stage_card(a: argparse.Namespace) -> None:
    work = a.ckpt_dir
    tok_dir, train_stream, val_stream, corpus = prepare_data(a)
    seq_len = TrainArgs(steps=1, lr=0).seq_len
    # Card numbers are computed as the test computes them: saved bf16 weights, run in fp32.
    target_dir, draft_dir = a.out / TARGET_NAME, a.out / DRAFT_NAME
    for d in (target_dir, draft_dir):
        copy_tokenizer(tok_dir, d)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    windows = val_windows(val_stream, seq_len, a.val_windows)
    # The test's slice: the first windows of the same fixed set, stored so it needs no stdlib.
    slice_windows = windows[: a.slice_windows, : a.slice_len + 1]
    (target_dir / "val_slice.json").write_text(json.dumps({
        "description": "fixed slice of the validation split (token ids, one list per window)",
        "windows": slice_windows.tolist(),
    }))
    results: dict = {"vocab_size": len(tokenizer), "uniform_loss": math.log(len(tokenizer))}
    results["val_tokens"] = int(windows[:, 1:].numel())
    results["val_slice_tokens"] = int(slice_windows[:, 1:].numel())
    results["val_slice_windows"] = len(slice_windows)
    results["agreement"] = greedy_agreement(target, draft, windows)
    results["slice_agreement"] = greedy_agreement(target, draft, slice_windows)
    for name, model in (("target", target), ("draft", draft)):
        loss = eval_loss(model, windows, bf16=False)
        slice_loss = eval_loss(model, slice_windows, bf16=False)
        # The same measure on training text: a large gap would mean the repeated epochs memorised it.
        train_loss = eval_loss(model, val_windows(train_stream, seq_len, a.val_windows), bf16=False)
        stats = train_stats(a, name, target_dir if name == "target" else draft_dir)
        results[name] = {
            "params": num_params(model),
            "shape": asdict(model_shape_of(model.config)),
            "val_loss": loss,
            "val_ppl": math.exp(loss),
            "val_slice_loss": slice_loss,
            "train_text_loss": train_loss,
            "epochs": total_tokens(stats) / len(train_stream),
            **stats,
        }
        log(f"{name}: val loss {loss:.4f} (ppl {math.exp(loss):.1f}), slice {slice_loss:.4f}, "
            f"training text {train_loss:.4f}")
    log(f"greedy agreement {results['agreement']:.3f} (slice {results['slice_agreement']:.3f})")
    results["sample_max_tokens"] = SAMPLE_MAX_TOKENS
    results["samples"], results["parses"] = {}, {}
    for name, d in (("target", target_dir), ("draft", draft_dir)):
        texts = [p + c for p, c in zip(SAMPLE_PROMPTS, engine_completions(d, SAMPLE_PROMPTS, SAMPLE_MAX_TOKENS))]
        results["samples"][name] = texts
        results["parses"][name] = [block_parses(t, p) for t, p in zip(texts, SAMPLE_PROMPTS)]
        log(f"{name}: first top-level block parses for {sum(results['parses'][name])}/{len(texts)} prompts")
    results["corpus"] = corpus
    results["python"] = sys.version.split()[0]
    results["commands"] = [run.get("command", f"(a {name} stage's command was not recorded)")
                           for name in ("target", "draft") for run in training_runs(results[name])] + [a.command]
    (work / "results.json").write_text(json.dumps(results, indent=2))
    for name, d in ((TARGET_NAME, target_dir), (DRAFT_NAME, draft_dir)):
        (d / "README.md").write_text(render_card(name, results))
        (d / "training_results.json").write_text(json.dumps(results, indent=2))
    log("cards written")


def render_card(name: str, r: dict) -> str:
    is_target = name == TARGET_NAME
    me = r["target" if is_target else "draft"]
    shape = ModelShape(**me["shape"])
    c = r["corpus"]
    ta, da = r["target"]["args"], r["draft"]["args"]
    left_out = c["files_left_out"]
    tests_note = (
        f"The test suites (`test/`, `tests/`, `idle_test/`: {c.get('files_tests', '?')} files) join the training\n"
        "stream only (--include-tests, added partway through the run); the tokenizer and the validation split are\n"
        "library files only."
        if c["include_tests"] else
        "Left out: the test suites (`test/`, `lib2to3/tests/` with its fixtures, `idlelib/idle_test/`),\n"
        "which pull completions into test boilerplate, and `site-packages`."
    )

    def row(key: str) -> str:
        m = r[key]
        runs = training_runs(m)
        steps, seconds = sum(run["train_steps"] for run in runs), sum(run["train_seconds"] for run in runs)
        return (f"| {key} | {m['params'] / 1e6:.2f}M | {steps} | {total_tokens(m) / 1e6:.2f}M "
                f"({m['epochs']:.1f} epochs) | {seconds / 60:.0f} min | {m['val_loss']:.3f} | "
                f"{m['val_ppl']:.1f} | {m['val_slice_loss']:.3f} | {m['train_text_loss']:.3f} |")

    def sample_block(who: str) -> str:
        return "\n".join(
            f"Prompt `{p!r}` (first top-level block {'parses' if ok else 'does not parse'}):\n\n```text\n{s}\n```\n"
            for p, s, ok in zip(SAMPLE_PROMPTS, r["samples"][who], r["parses"][who])
        )

    role = (
        "the **target** of pagedllm's bundled pair: the default model of `pagedllm` commands"
        if is_target else
        f"the **draft** of pagedllm's bundled pair, distilled from `{TARGET_NAME}` for speculative decoding"
    )
    history_rows, done_steps, done_tokens = [], 0, 0
    for run in training_runs(me):  # a continued run's steps and tokens count on from the earlier ones
        history_rows += [f"| {done_steps + h['step']} | {(done_tokens + h['tokens']) / 1e6:.2f}M | "
                         f"{h['val_loss']:.3f} |" for h in run["history"]]
        done_steps, done_tokens = done_steps + run["train_steps"], done_tokens + run["train_tokens"]
    history = "\n".join(history_rows)
    alpha = r["agreement"]

    def run_row(i: int, run: dict) -> str:
        where = {**FIRST_RUNS_MACHINE, **{k: run[k] for k in ("machine", "precision", "threads") if k in run}}
        data = "library + test suites" if c["include_tests"] else "library"
        if run.get("on_policy_prompts"):
            data = (f"the target's greedy continuations of {run['on_policy_prompts']:,} training windows, "
                    f"and as many tokens of {data}")
        return (f"| {i} | {run['train_steps']} | {run['train_tokens'] / 1e6:.2f}M | "
                f"{run['train_seconds'] / 60:.0f} min | {where['machine']} | {where['precision']}, "
                f"{where['threads']} | {run['args']['lr']:g} | {data} |")

    runs_table = "\n".join(run_row(i, run) for i, run in enumerate(training_runs(me), 1))
    stopped = (
        f"It was stopped by `--{'' if is_target else 'draft-'}stop-at` after {me['train_steps']} of "
        f"{me['planned_steps']} planned steps; the\n"
        "learning-rate schedule follows wall time in that case, so it still ended at a tenth of the peak."
        if me.get("stopped_early") else f"It ran all {me['planned_steps']} planned steps."
    )
    return f"""# {name}

A small Llama-architecture model of Python code, {role}. It was trained from scratch on the
Python {r['python']} standard library by `tools/train_demo_models.py` (seeded). It is a demo: it writes
Python-shaped text, not correct programs.

Exact commands, in the order they ran (from the repository root; rerunning one resumes from the
checkpoints in `--ckpt-dir`; without `--stage` one command runs all three stages):

```text
{chr(10).join(r['commands'])}
```

## Corpus
The `.py` files under `sysconfig.get_paths()["stdlib"]`. {tests_note}
Also left out, judged by content: {left_out['data_like']} data-like files, those where at least half of the
non-blank lines hold only literals (the charmap codecs in `encodings/`, `html/entities.py`, `locale.py`'s
alias tables, pydoc's topic strings); {left_out['duplicate']} exact duplicates (by SHA-256 of the text) and
{left_out['unreadable_or_empty']} empty or non-UTF-8 files. Split by file with a seeded hash of the path
(SHA-256 of `"{c.get('split_seed', 0)}:<path>"`, first 4 bytes mod 100 < 5 is validation): {c['files_train']} training
files ({c['chars_train'] / 1e6:.1f}M characters, {c['tokens_train'] / 1e6:.2f}M tokens) and {c['files_val']}
validation files ({c['chars_val'] / 1e6:.2f}M characters, {c['tokens_val'] / 1e3:.0f}k tokens). Each file is
one document: `<|bos|>` text `<|eos|>`, concatenated; training samples random {ta['seq_len']}-token windows.

## Tokenizer
Byte-level BPE (`tokenizers`), {r['vocab_size']} tokens, trained on the training split. Special tokens
`<|bos|>` (0), `<|eos|>` (1), `<|pad|>` (2). Encoding prepends `<|bos|>`; decoding round-trips any
text exactly. The chat template only joins message contents with newlines (the model has no roles).
Both model directories carry the same tokenizer files.

## Architecture
`LlamaForCausalLM`: hidden {shape.hidden_size}, {shape.num_hidden_layers} layers,
{shape.num_attention_heads} query / {shape.num_key_value_heads} KV heads (head dim
{shape.hidden_size // shape.num_attention_heads}; both head counts divide by 4, so tensor_parallel_size 1,
2 and 4 each get whole KV heads), MLP {shape.intermediate_size}, tied embeddings, RoPE theta 10000,
`max_position_embeddings` 2048 (trained on {ta['seq_len']}-token windows; longer contexts rely on RoPE
extrapolation and degrade). {me['params']:,} parameters, stored as bf16 safetensors.

## Training
Seeded, with `torch.compile` on the model. AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), batches of
{ta['batch_size']} x {ta['seq_len']} tokens, linear warmup then cosine decay to a tenth of the peak,
gradient clipping 1.0. Target: next-token loss. Draft: loss
{da['distill_alpha']:g} x KL(target || draft) at temperature {da['distill_temperature']:g} +
{1 - da['distill_alpha']:g} x next-token loss, the target's distribution computed on the same windows,
so that its greedy choices follow the target's. {stopped}
The runs behind these weights (each later run continues the one before with a fresh optimizer;
bf16 autocast keeps fp32 master weights and pays only on CPUs with bf16 matmul units):

| run | steps | tokens | time | machine | precision, threads | peak lr | data |
|---|---|---|---|---|---|---|---|
{runs_table}

Checkpoints every 3 minutes (model, optimizer, step, RNG and data position) let a killed run resume.

Validation loss during training (the first 8 validation windows, in the run's precision):

| step | tokens | val loss |
|---|---|---|
{history}

## Results
Validation loss is the mean next-token cross-entropy (nats) over {r['val_tokens']:,} tokens of fixed
windows of the validation split, computed from the saved bf16 weights in fp32. A uniform guess scores
ln({r['vocab_size']}) = {r['uniform_loss']:.3f}. The slice column is the {r['val_slice_tokens']:,}-token
slice stored in `pycode-target/val_slice.json` (the first {r['val_slice_windows']} of those windows).
`tests/test_demo_models.py` recomputes both from the weights (the full set rebuilt from the standard
library on disk, split as here, when it is this Python's), and the greedy agreement below. Validation
files differ a lot in how predictable they are, so the slice and the full set give different numbers;
compare models on one of them. The last column is the same measure on windows of the training split: the
gap to the validation loss shows how much of the repeated epochs went into memorising the training files
rather than into Python in general.

| model | params | steps | tokens | train time | val loss | val ppl | slice loss | training-text loss |
|---|---|---|---|---|---|---|---|---|
{row('target')}
{row('draft')}

**Greedy agreement** of the draft with the target: **{alpha:.3f}** (fraction of validation positions,
teacher-forced on the real text, where the draft's most likely next token equals the target's). If every
proposed token were accepted with that probability, k = 5 speculative tokens would give
(1 - a^6) / (1 - a) = {(1 - alpha ** 6) / (1 - alpha):.2f} tokens per target pass.

## Sample completions (target, greedy, {r['sample_max_tokens']} new tokens, pagedllm in fp32)
"First top-level block" is the prompt's `def`/`class` line and everything after it up to the next line
that starts at column 0 (or the end); it parses with `ast.parse` for
{sum(r['parses']['target'])} of {len(SAMPLE_PROMPTS)} prompts (the draft: {sum(r['parses']['draft'])}).

{sample_block('target')}
## Sample completions (draft, same prompts)
{sample_block('draft')}
## Use
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from pagedllm.assets import demo_model_path, demo_draft_path
tok = AutoTokenizer.from_pretrained(demo_model_path())
model = AutoModelForCausalLM.from_pretrained(demo_model_path())
```
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=["all", "target", "draft", "card"], default="all")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent dir of the two model dirs")
    p.add_argument("--ckpt-dir", type=Path, default=Path.home() / ".cache" / "pagedllm" / "train_demo_models",
                   help="checkpoints, tokenizer and token streams (outside the git tree); reruns resume from it")
    p.add_argument("--seed", type=int, default=0, help="seeds initialisation, the training windows and sampling")
    p.add_argument("--split-seed", type=int, default=0,
                   help="seeds the held-out split by file (and so the tokenizer); kept apart from --seed so that "
                        "a run continuing saved weights with other windows (--seed) never trains on held-out files")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--include-tests", action="store_true", help="also train on the stdlib's test suites")
    p.add_argument("--target-shape", type=model_shape, default=TARGET_SHAPE, metavar="H,L,HEADS,KV,FFN",
                   help="hidden size, layers, query heads, KV heads, MLP size (default: %(default)s)")
    p.add_argument("--draft-shape", type=model_shape, default=DRAFT_SHAPE, metavar="H,L,HEADS,KV,FFN")
    p.add_argument("--target-lr", type=float, default=2e-3, help="the target's peak learning rate")
    p.add_argument("--draft-lr", type=float, default=3e-3, help="the draft's peak learning rate")
    p.add_argument("--init-target", type=Path, default=None, metavar="DIR",
                   help="continue training this saved target (its tokenizer too) instead of starting from scratch")
    p.add_argument("--on-policy-prompts", type=int, default=0, metavar="N",
                   help="also distil the draft on the target's greedy continuations of N training windows")
    p.add_argument("--init-draft", type=Path, default=None, metavar="DIR",
                   help="continue distilling this saved draft instead of starting from scratch")
    p.add_argument("--target-tokens", type=float, default=12e6, help="training tokens for the target")
    p.add_argument("--draft-tokens", type=float, default=2e6, help="distillation tokens for the draft")
    p.add_argument("--scale", type=float, default=1.0, help="multiply both token budgets (0.01 = smoke run)")
    p.add_argument("--stop-at", default=None, metavar="HH:MM", help="end the target's training at this UTC time")
    p.add_argument("--draft-stop-at", default=None, metavar="HH:MM", help="end the draft's training at this UTC time")
    p.add_argument("--val-windows", type=int, default=64, help="256-token windows for the card's val loss")
    p.add_argument("--slice-windows", type=int, default=12, help="windows in the test's stored slice")
    p.add_argument("--slice-len", type=int, default=256, help="tokens per window of the test's slice")
    # One thread: with other jobs on the 2 cores, a second OpenMP thread made steps slower, not faster.
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="train in fp32 (default: bf16 autocast where the CPU has bf16 matmul units)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model for training")
    a = p.parse_args()
    a.command = shlex.join(["python", "tools/train_demo_models.py", *sys.argv[1:]])
    if a.bf16 and not cpu_has_bf16():
        log("this CPU has no AVX512-bf16/AMX: training in fp32 (bf16 matmuls would be emulated, slower)")
        a.bf16 = False
    torch.set_num_threads(a.threads)
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    a.ckpt_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.stage in ("all", "target"):
        stage_target(a)
    if a.stage in ("all", "draft"):
        stage_draft(a)
    if a.stage in ("all", "card"):
        stage_card(a)
    log(f"done in {(time.time() - t0) / 60:.1f} min")


def model_shape_of(cfg: LlamaConfig) -> ModelShape:
    return ModelShape(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.intermediate_size)


def model_shape(text: str) -> ModelShape:
    """--target-shape / --draft-shape: five comma-separated integers."""
    try:
        return ModelShape(*map(int, text.split(",")))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected H,L,HEADS,KV,FFN (five integers), got {text!r}") from None


def cpu_has_bf16() -> bool:
    """bf16 autocast pays only with bf16 dot-product units (AVX512-bf16 or AMX); elsewhere it is
    emulated and runs several times slower than fp32. Measured here: 977 vs 136 GFLOP/s (bf16 vs
    fp32) for a 4096x384 @ 384x1536 matmul on 2 Zen 4 threads."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


if __name__ == "__main__":
    main()
