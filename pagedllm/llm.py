"""LLM: the offline entry point, with vLLM's signature. `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType, run_worker_node
from pagedllm.metrics.reader import Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        args = EngineArgs(model=model, **kwargs)
        if args.node_rank > 0:
            # Several nodes: only node 0 runs the engine. Here the call hosts this node's tensor-parallel
            # ranks and returns when node 0 shuts them down; this LLM cannot generate.
            run_worker_node(args)
            self.llm_engine: LLMEngine | None = None
            return
        self.llm_engine = LLMEngine.from_engine_args(args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if self.llm_engine is None:
            raise ValueError("node_rank > 0: this LLM hosted worker ranks; generate on node 0.")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts.")
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": render_chat(tokenizer, conv, add_generation_prompt, chat_template)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = engine.next_request_id()
                engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except ValueError:
            engine.abort_request(ids)  # refuse the whole call, leaving nothing behind
            raise
        finals: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finals) < len(ids) and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finals[output.request_id] = output
                        bar.update(1)
        return [finals[request_id] for request_id in ids]

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (they also stop when the LLM is collected, at exit,
        and when this process dies)."""
        self.llm_engine.shutdown()


def render_chat(tokenizer, messages: ChatMessages, add_generation_prompt: bool = True,
                chat_template: str | None = None) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         chat_template=chat_template)
    # The template already holds any BOS it wants; don't let the tokenizer add another.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)
