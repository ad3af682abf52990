"""LLM: the offline entry point, with vLLM's signature. `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, run_worker_node
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.reader import Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import message_text

ChatMessages = list[dict[str, Any]]


class LLM:
    """`LLM(model=DIR, **engine_args)`; engine_args are EngineArgs' fields, among them `num_threads`
    (torch CPU threads; default OMP_NUM_THREADS, else torch's) and `generation_config` ("auto": default
    sampling from the model's generation_config.json, as vLLM; "vllm": SamplingParams' own)."""

    def __init__(self, model: str, **kwargs: Any):
        args = EngineArgs(model=model, **kwargs)
        if args.node_rank > 0:
            # Several nodes: only node 0 runs the engine. Here the call hosts this node's tensor-parallel
            # ranks and returns when node 0 shuts them down; this LLM cannot generate.
            run_worker_node(args)
            self.llm_engine: LLMEngine | None = None
            return
        self.llm_engine = LLMEngine.from_engine_args(args)
        self.default_sampling_params: dict[str, Any] | None = None

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no SamplingParams: the model's generation config
        (max_new_tokens, do_sample, temperature, top_p, top_k, min_p, repetition_penalty) over
        SamplingParams' defaults, unless the engine was built with generation_config="vllm"."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.llm_engine.model_config.get_diff_sampling_param()
        return SamplingParams(**self.default_sampling_params)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or a list with one (or None: the base model) per
        prompt (needs enable_lora=True). priority: vLLM's, for its priority scheduling, which this engine
        does not have: all zeros or nothing."""
        if self.llm_engine is None:
            raise ValueError("node_rank > 0: this LLM hosted worker ranks; generate on node 0.")
        if priority is not None and any(priority):
            raise ValueError("priority: requests here run first come first served (or by cached prefix with "
                             "scheduling_policy='lpm'); there is no priority scheduling.")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"lora_request has {len(lora_list)} entries for {len(prompt_list)} prompts.")
        return self._run(prompt_list, params_list, use_tqdm, lora_list)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool | None = None,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             tools: list[dict[str, Any]] | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Generate replies to conversations through the tokenizer's chat template.

        continue_final_message=True extends the last message (say, a started assistant reply) instead
        of opening a new turn; add_generation_prompt then defaults to False (vLLM: both cannot be True).
        tools (OpenAI's function specs) go to the template, as vLLM passes them; content parts reach it as
        one string ("auto", "string") or as the parts themselves ("openai").
        """
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                             f"{chat_template_content_format!r}.")
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template.")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = render_chat_text(tokenizer, conversation, add_generation_prompt, chat_template,
                                    continue_final_message, chat_template_kwargs,
                                    as_text=chat_template_content_format != "openai")
            # the template already holds any BOS it wants; don't let the tokenizer add another
            token_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool,
             loras: list[LoRARequest | None]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                request_id = engine.next_request_id()
                if isinstance(p, SamplingParams) and p.output_kind is not RequestOutputKind.FINAL_ONLY:
                    # as vLLM's LLM: only the final outputs are returned, so none is built before
                    p = p.clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(request_id, prompt, p, lora_request=lora)
                ids.append(request_id)
        except ValueError:
            engine.abort_request(ids)  # refuse the whole call, leaving nothing behind
            raise
        finals: dict[str, RequestOutput] = {}
        # tokens each request may generate (max_tokens as the engine resolved it, times n): the progress bar's unit
        budgets = {request_id: (state.params.max_tokens or 1) * state.params.n
                   for request_id in ids if (state := engine.output_processor.states.get(request_id))}
        progress = _Progress(budgets, engine, disable=not use_tqdm)
        with progress, torch.inference_mode():  # entered once, not per step (see ModelRunner.execute)
            while len(finals) < len(ids) and engine.has_unfinished_requests():
                outputs = engine.step()
                for output in outputs:
                    if output.finished and output.request_id in budgets:  # not another caller's request
                        finals[output.request_id] = output
                failed = [request_id for request_id in ids if request_id in engine.failed_requests] \
                    if engine.failed_requests else []
                if failed:  # the step ended these alone; the call as a whole cannot succeed
                    engine.abort_request(ids)
                    raise RuntimeError(f"request {failed[0]} failed inside the engine "
                                       "(see the log)") from engine.failed_requests[failed[0]]
                progress.update(outputs, len(finals))
        return [finals[request_id] for request_id in ids]

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (they also stop when the LLM is collected, at exit,
        and when this process dies)."""
        self.llm_engine.shutdown()


def render_chat_text(tokenizer, messages: ChatMessages, add_generation_prompt: bool = True,
                     chat_template: str | None = None, continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None, as_text: bool = True) -> str:
    """The prompt text a conversation makes through the tokenizer's chat template (as_text: each message's
    content parts joined into one string first)."""
    if as_text:
        messages = [{**message, "content": message_text(message.get("content"))} for message in messages]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             chat_template=chat_template,
                                             continue_final_message=continue_final_message,
                                             **(chat_template_kwargs or {}))
    except ValueError as exc:
        raise ValueError(f"messages: {exc}") from exc


class _Progress:
    """vLLM's progress bar: finished prompts, with input and output tokens/s.

    The bar also advances with the tokens generated so far (each unfinished request counts as the
    share of its max_tokens it has produced), so prompts of equal length that all finish together
    at the end do not sit at 0% for the whole run."""

    def __init__(self, budgets: dict[str, int], engine: LLMEngine, disable: bool) -> None:
        self.budgets = budgets
        self.num_prompts = num_prompts = len(budgets)
        self.engine = engine
        self.bar = tqdm(total=num_prompts, desc="Processed prompts", disable=disable, dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| {postfix} [{elapsed}<{remaining}]")
        self.start = time.perf_counter()
        # the requests were admitted (their prompt tokens counted) just before the bar starts
        self.start_prompt = engine.num_prompt_tokens - sum(
            len(state.prompt_token_ids) for request_id in budgets
            if (state := engine.output_processor.states.get(request_id)))
        self.start_generation = engine.num_generation_tokens
        self.partial: dict[str, float] = {}
        self.last_refresh = 0.0

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def update(self, outputs: list[RequestOutput], num_finished: int) -> None:
        if self.bar.disable:
            return
        now = time.perf_counter()
        if now - self.last_refresh < 0.2 and num_finished < self.num_prompts:
            return
        self.last_refresh = now
        # outputs come at the end only (FINAL_ONLY): read the progress of the others in the core
        generated = self.engine.num_output_tokens()
        self.partial = {request_id: min(generated[request_id] / budget, 0.99)
                        for request_id, budget in self.budgets.items() if request_id in generated}
        elapsed = max(now - self.start, 1e-9)
        input_rate = (self.engine.num_prompt_tokens - self.start_prompt) / elapsed
        output_rate = (self.engine.num_generation_tokens - self.start_generation) / elapsed
        self.bar.n = num_finished + sum(self.partial.values())
        self.bar.set_postfix_str(f"{num_finished}/{self.num_prompts} prompts, est. speed input: "
                                 f"{input_rate:.2f} toks/s, output: {output_rate:.2f} toks/s", refresh=False)
        self.bar.refresh()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)
