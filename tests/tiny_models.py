"""Tiny random-weight Hugging Face checkpoints for tests.

Every test that needs a model builds one here in a tmp dir: a byte-level BPE tokenizer trained on a
fixed text, a transformers config + model with seeded random weights, saved exactly as a published
checkpoint would be. `hf_greedy` / `hf_logits` give the transformers reference for parity tests.

Import from tests as `from tiny_models import build_model, ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]

# A minimal jinja chat template: role headers, then the assistant header when a reply is wanted.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Fixed training text: inlined code and prose, plus a few stdlib modules whose source is stable for a
# given Python version. The same text always yields the same tokenizer, so tests are reproducible.
_INLINE_TEXT = '''
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
A paged key-value cache stores attention keys and values in fixed-size blocks.
Continuous batching lets new requests join while others are still decoding.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 3.14159 -7 +8 = == != <= >= ( ) [ ] { } : ; , .
'''
_STDLIB_MODULES = ("textwrap", "heapq", "bisect", "colorsys", "string")

_TOKENIZER_JSON_CACHE: dict[int, str] = {}


def training_text() -> str:
    import importlib

    parts = [_INLINE_TEXT]
    for name in _STDLIB_MODULES:
        parts.append(inspect.getsource(importlib.import_module(name)))
    return "\n".join(parts)


def _train_tokenizer_json(vocab_size: int) -> str:
    """Train (once per vocab_size per process) a byte-level BPE and return its JSON."""
    if vocab_size not in _TOKENIZER_JSON_CACHE:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([training_text()], trainer=trainer)
        _TOKENIZER_JSON_CACHE[vocab_size] = tok.to_str()
    return _TOKENIZER_JSON_CACHE[vocab_size]


def build_tokenizer(dir: str | os.PathLike, vocab_size: int = 512) -> Any:
    """Save a tiny byte-level BPE tokenizer (with chat template) into `dir`; return it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )
    Path(dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(dir))
    return tok


def build_word_tokenizer(dir: str | os.PathLike, vocab_size: int = 12) -> Any:
    """Save a WordLevel tokenizer over `vocab_size` ids: 3 specials then words w3, w4, ...

    For the tiny-vocabulary model, where prompts are token ids and only loading needs a tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert vocab_size > len(SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok_obj = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok_obj.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_obj.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok_obj.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tok_obj, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    Path(dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(dir))
    return tok


_ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def _rope_parameters(rope_theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default"}
    if rope_scaling:
        params.update(rope_scaling)
        if "type" in params:  # the pre-2024 spelling of rope_type
            params["rope_type"] = params.pop("type")
    params["rope_theta"] = rope_theta
    return params


def build_model(
    dir: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    rope_spelling: str = "new",
    max_position_embeddings: int = 1024,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    initializer_range: float = 0.25,
    tokenizer: str = "bpe",
    tokenizer_vocab_size: int = 512,
    extra_config: dict[str, Any] | None = None,
) -> str:
    """Build a random-weight checkpoint of `arch` in `dir` and return `str(dir)`.

    `rope_spelling="legacy"` rewrites config.json as transformers 4 wrote it, as most published
    checkpoints are: top-level `rope_theta` and `rope_scaling` (exactly the dict passed, so
    {"type": "linear", ...} keeps the older `type` key), `torch_dtype` instead of `dtype`, and no
    `head_dim` when it is hidden_size // num_attention_heads. transformers 5 writes `rope_parameters`.
    `attention_bias=None` means the architecture's usual choice (qkv bias for qwen2 only).
    `tokenizer="word"` uses a WordLevel tokenizer of `vocab_size` ids (tiny-vocabulary models).
    `extra_config` adds architecture fields (experts, MLA ranks, routing) to the transformers config.
    """
    import transformers

    if arch not in _ARCHES:
        raise ValueError(f"arch must be one of {sorted(_ARCHES)}, got {arch!r}")
    if rope_spelling not in ("new", "legacy"):
        raise ValueError(f"rope_spelling must be 'new' or 'legacy', got {rope_spelling!r}")
    dir = Path(dir)
    if tokenizer == "word":
        tok = build_word_tokenizer(dir, vocab_size=vocab_size or 12)
    else:
        tok = build_tokenizer(dir, vocab_size=tokenizer_vocab_size)
    if vocab_size is None:
        vocab_size = len(tok)
    assert vocab_size >= len(tok), "model vocab must cover the tokenizer"

    config_cls = getattr(transformers, _ARCHES[arch][0])
    model_cls = getattr(transformers, _ARCHES[arch][1])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rope_parameters=_rope_parameters(rope_theta, rope_scaling),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if arch in ("llama", "qwen3", "qwen3_moe"):
        kwargs["attention_bias"] = bool(attention_bias)
    elif arch == "qwen2":
        # Qwen2 always has qkv bias in transformers; it has no attention_bias switch.
        assert attention_bias in (None, True), "qwen2 has qkv bias by construction"
    elif arch == "mistral":
        assert not attention_bias, "mistral has no attention bias"
        kwargs["sliding_window"] = None
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        kwargs["use_sliding_window"] = False
    if arch == "mixtral":
        kwargs["sliding_window"] = None
    if arch == "gemma3":
        # RoPE per layer type: global layers rope_theta (with any scaling), local ones plain.
        kwargs["rope_parameters"] = {"full_attention": _rope_parameters(rope_theta, rope_scaling),
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    kwargs.update(extra_config or {})
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    _randomize_(model, initializer_range, seed)
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(dir), safe_serialization=True)

    if rope_spelling == "legacy":
        _rewrite_config_legacy(dir / "config.json", rope_scaling)
    return str(dir)


@torch.no_grad()
def _randomize_(model: torch.nn.Module, std: float, seed: int) -> None:
    """Make every parameter random, so no path (biases, norms) is trivially identity or zero.

    HF init leaves biases at 0 and norm weights at 1; parity tests must exercise them too.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:  # input_layernorm, q_norm, model.norm ...: scale around 1
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:  # weights and biases alike
            p.copy_(std * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias, zero at init
            b.copy_(std * torch.randn(b.shape, generator=gen))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def _rewrite_config_legacy(config_path: Path, rope_scaling: dict[str, Any] | None) -> None:
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg.get("head_dim") == cfg["hidden_size"] // cfg["num_attention_heads"]:
        del cfg["head_dim"]
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_tiny_vocab_model(dir: str | os.PathLike, vocab_size: int = 12, seed: int = 0, **kwargs: Any) -> str:
    """A Llama over `vocab_size` ids with a WordLevel tokenizer, for chi-square sampling tests.

    A larger init makes the next-token distribution clearly non-uniform, so a wrong temperature or
    a wrong softmax shows up in the frequencies.
    """
    kwargs.setdefault("initializer_range", 0.3)
    kwargs.setdefault("hidden_size", 32)
    kwargs.setdefault("intermediate_size", 64)
    return build_model(dir, "llama", vocab_size=vocab_size, tokenizer="word", seed=seed, **kwargs)


_HF_MODEL_CACHE: dict[str, Any] = {}


def load_hf(dir: str | os.PathLike) -> Any:
    """Load (and cache per path) the transformers model in eval mode, fp32 as saved."""
    from transformers import AutoModelForCausalLM

    key = str(dir)
    if key not in _HF_MODEL_CACHE:
        model = AutoModelForCausalLM.from_pretrained(key, dtype="auto")
        model.eval()
        _HF_MODEL_CACHE[key] = model
    return _HF_MODEL_CACHE[key]


@torch.no_grad()
def hf_logits(dir: str | os.PathLike, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] (float32) of transformers on one unpadded sequence."""
    model = load_hf(dir)
    out = model(input_ids=torch.tensor([ids], dtype=torch.long))
    return out.logits[0].float()


@torch.no_grad()
def hf_greedy(
    dir: str | os.PathLike, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """transformers greedy `generate` for one prompt, without eos stop.

    Returns (exactly max_new_tokens new ids, float32 logits of the prompt's last position).
    """
    model = load_hf(dir)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.generation_config.pad_token_id,
        output_scores=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new_ids = out.sequences[0, len(prompt_ids) :].tolist()
    assert len(new_ids) == max_new_tokens
    return new_ids, out.logits[0][0].float()


def random_prompts(
    n: int, vocab_size: int, lengths: list[int] | None = None, seed: int = 0, low: int = 3
) -> list[list[int]]:
    """`n` token-id prompts with ids in [low, vocab_size) (specials excluded), deterministic."""
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, 64, (n,), generator=gen).tolist()
    assert len(lengths) == n
    return [torch.randint(low, vocab_size, (length,), generator=gen).tolist() for length in lengths]


def staggered_greedy_requests(vocab_size: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """Ten token-id prompts (1 to 40 tokens) with greedy SamplingParams that end them at different steps,
    by length (6 to 42 tokens) or, for every third, by a stop token: (inputs, params) for LLM.generate."""
    from pagedllm import SamplingParams

    prompts = random_prompts(10, vocab_size, [3, 17, 30, 1, 9, 16, 40, 5, 12, 25], seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + (9 * i) % 37, ignore_eos=i % 3 != 0,
                             stop_token_ids=[] if i % 3 else list(range(200, 230))) for i in range(len(prompts))]
    return [{"prompt_token_ids": p} for p in prompts], params


def metric_values(llm: Any) -> dict[str, float]:
    """`{name: value}` of `llm.get_metrics()`, summing over label sets (e.g. finish reasons)."""
    values: dict[str, float] = {}
    for m in llm.get_metrics():
        values[m.name] = values.get(m.name, 0.0) + float(m.value)
    return values


def perturbed_copy(src: str | os.PathLike, dst: Path, noise: float, seed: int = 0) -> str:
    """The same model with every weight jittered: a draft that agrees with the target often, not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    weights = {name: w + noise * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)
               for name, w in weights.items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


ALL_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora_adapter(base_dir: str | os.PathLike, dst: str | os.PathLike, *, r: int = 8, lora_alpha: int = 16,
                       target_modules: list[str] | None = None, use_rslora: bool = False, seed: int = 0,
                       b_std: float = 0.1, dtype: torch.dtype = torch.float32) -> str:
    """A PEFT LoRA adapter of the model in `base_dir`, saved by `get_peft_model(...).save_pretrained` with
    seeded random A and nonzero B (std b_std), so it visibly changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules or ALL_LORA_TARGETS,
                        lora_dropout=0.0, use_rslora=use_rslora, init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * (b_std if "lora_B" in name else 0.3))
                param.data = param.data.to(dtype)
    model.save_pretrained(str(dst))
    return str(dst)


def load_hf_peft(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike) -> Any:
    """transformers + PEFT: the base model with the adapter, fp32, eval mode (cached per pair)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = f"{base_dir}|{adapter_dir}"
    if key not in _HF_MODEL_CACHE:
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(adapter_dir))
        model.float().eval()
        _HF_MODEL_CACHE[key] = model
    return _HF_MODEL_CACHE[key]


@torch.no_grad()
def hf_peft_greedy(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None, prompt_ids: list[int],
                   max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(greedy new ids, logits at every generated position [max_new_tokens, vocab]) of transformers + PEFT
    (adapter_dir None: the base model), by repeated full forward passes (no cache: the plainest oracle)."""
    model = load_hf_peft(base_dir, adapter_dir) if adapter_dir is not None else load_hf(base_dir)
    ids = list(prompt_ids)
    logits = []
    for _ in range(max_new_tokens):
        out = model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0, -1].float()
        logits.append(out)
        ids.append(int(out.argmax()))
    return ids[len(prompt_ids):], torch.stack(logits)
