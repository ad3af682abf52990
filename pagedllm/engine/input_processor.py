"""Prompts and SamplingParams in, EngineCoreRequests out, in the API process (vLLM V1's input processor):
tokenize, check every bound the engine has, resolve max_tokens and the stop token ids.

Everything a bad request could break is checked here, before the request reaches the core, so a
ValueError naming the parameter reaches the caller (an HTTP 400) and no step ever fails on bad input.
"""

from __future__ import annotations

from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.core_types.engine_core import EngineCoreRequest
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.inputs import PromptType
from pagedllm.kv_cache.manager import blocks_per_request
from pagedllm.lora.peft import validate_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputManager


def truncate_prompt(token_ids: list[int], keep: int, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: as many as the context holds
    with one token left to generate)."""
    return token_ids[-(max_model_len - 1 if keep == -1 else keep):]


class InputProcessor:
    def __init__(self, args: EngineArgs, model_config: ModelConfig, tokenizer: Any, block_size: int,
                 num_blocks: int, structured_output_manager: StructuredOutputManager | None = None,
                 group_windows: list[int | None] | None = None, max_num_batched_tokens: int = 0) -> None:
        self.args = args
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.num_blocks = num_blocks
        # the windows the KV cache manager frees blocks out of, per group (CacheConfig.group_windows; one full
        # group when none is given): a request must fit in the pool at its peak, a prefill chunk in flight
        # in every sliding group
        self.group_windows = group_windows or [None]
        self.max_num_batched_tokens = max_num_batched_tokens
        # compiles each guided-decoding spec once here so a bad one is a ValueError, not a failed step
        # (an in-process core shares its manager, so its cache of compiled grammars serves both)
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(
            tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        self._valid_loras: set[tuple[int, str]] = set()  # (lora_int_id, lora_path) checked already

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids.")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                arrival_time: float, lora_request: LoRARequest | None = None) -> tuple[str | None, EngineCoreRequest]:
        """(the prompt's text if it had one, the request for the core); ValueError for bad input."""
        self.validate_lora(lora_request)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.model_config.max_model_len)
            if len(kept) < len(token_ids):
                token_ids, text = kept, None  # (the text no longer matches the tokens)
        self.validate(token_ids, params)
        params = params.clone()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) == -1:
                setattr(params, name, self.model_config.vocab_size)
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - len(token_ids)
        # As vLLM: the model's EOS ids (generation_config's included) are among the ids min_tokens masks
        # even with ignore_eos, which only stops EOS from ending the request.
        params.all_stop_token_ids = set(params.stop_token_ids) | set(self.model_config.eos_token_ids)
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        return text, EngineCoreRequest(request_id, token_ids, params, arrival_time, lora_request)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it starts a text and, where that tokenizes differently into as many
        tokens, after a space (as vLLM tokenizes bad_words), so it is kept out at the start and inside."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer, and this model has none.")
        sequences: list[list[int]] = []
        for word in words:
            bare = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                continue
            sequences.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        vocab = self.model_config.vocab_size
        if any(token >= vocab for ids in sequences for token in ids):
            raise ValueError(f"bad_words token ids must be in [0, {vocab}).")
        return sequences

    def validate_lora(self, lora_request: LoRARequest | None) -> None:
        """The adapter's config and tensor shapes against the model (its header only: the engine core reads
        the weights), each adapter once."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        lora_config = self.model_config.lora_config
        if lora_config is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled; start the engine "
                             "with enable_lora=True (--enable-lora).")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._valid_loras:
            validate_adapter(lora_request.lora_path, lora_config, self.model_config)
            self._valid_loras.add(key)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("prompt must not be empty.")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}).")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(token >= vocab for token in ids):
                raise ValueError(f"{name} token ids must be in [0, {vocab}), got {max(ids)}.")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, which is not below max_model_len={max_len}.")
        # (as vLLM's LLM: max_tokens past the context is not refused; the request ends by length there)
        total = min(max_len, len(token_ids) + (params.max_tokens or max_len))
        first_chunk = min(len(token_ids), self.max_num_batched_tokens)
        if blocks_per_request(self.group_windows, total, self.block_size, first_chunk) > self.num_blocks:
            groups = len(self.group_windows)
            raise ValueError(f"prompt plus max_tokens ({total} tokens) can never fit in the KV cache of "
                             f"{self.num_blocks} blocks of {self.block_size} tokens"
                             + (f" (shared by {groups} KV cache groups: the full and the sliding layers each hold "
                                "blocks of their own)." if groups > 1 else "."))
        max_logprobs = self.args.max_logprobs if self.args.max_logprobs >= 0 else vocab  # -1: no limit
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked == -1:
                asked = vocab  # (the whole vocabulary: process() sets it once the params are the engine's copy)
            if (asked or 0) > max_logprobs:
                raise ValueError(f"{name} must be at most max_logprobs={max_logprobs}, got {getattr(params, name)}"
                                 + (f" (the whole vocabulary of {vocab})." if asked == vocab else "."))
        # Everything below would otherwise fail (or slow every request) inside a step.
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids contains token id {bad[0]}, outside the vocabulary [0, {vocab}).")
        if len(params.stop_token_ids) > self.args.max_stop_token_ids:
            raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} entries; the limit is "
                             f"max_stop_token_ids={self.args.max_stop_token_ids}.")
        if len(params.stop) > self.args.max_stop_strings:
            raise ValueError(f"stop has {len(params.stop)} strings; the limit is "
                             f"max_stop_strings={self.args.max_stop_strings}.")
        longest = max((len(stop) for stop in params.stop), default=0)
        if longest > self.args.max_stop_string_len:
            raise ValueError(f"stop has a string of {longest} characters; the limit is "
                             f"max_stop_string_len={self.args.max_stop_string_len}.")
        if params.guided_decoding is not None:
            if self.tokenizer is None:
                raise ValueError("guided_decoding needs the model's tokenizer, and this model has none.")
            self.structured_output_manager.compile(params.guided_decoding)  # ValueError if it cannot compile
