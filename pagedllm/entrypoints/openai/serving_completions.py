"""POST /v1/completions.

A request with several prompts becomes one engine request per prompt; their outputs arrive on one
shared queue, and choice i*n + j is sample j of prompt i, as in OpenAI's and vLLM's servers.
A stream asks the engine for DELTA outputs (what each choice gained since the last one), so its cost per
token does not grow with the output; a non-streaming request asks for FINAL_ONLY (one output at the end).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import OutputQueue, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    CompletionFinalChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    APIError,
    ChoiceState,
    ServingContext,
    abort_all,
    decoded,
    finite,
    logprob_rank,
    merged_outputs,
    prompt_logprobs_json,
    sse,
    stream_error_event,
    stream_response,
    until_disconnect,
)
from pagedllm.entrypoints.openai.structured_outputs import constraint_renames, guided_decoding_params
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class OpenAIServingCompletion:
    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.tokenizer = context.tokenizer

    async def _prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif not prompt:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        token_lists = []
        for item in items:
            token_ids = await self.context.encode_prompt(item) if isinstance(item, str) else list(item)
            if not token_ids:
                raise APIError(400, "prompt must not be empty.", param="prompt")
            self.context.check_token_ids(token_ids, "prompt")
            token_lists.append(token_ids)
        return token_lists

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        context = self.context
        model_name = context.check_model(request.model)
        if request.suffix:
            raise APIError(400, "suffix is not supported.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(400, "best_of is not supported (only best_of == n).", param="best_of")
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options can only be given when stream is true.",
                           param="stream_options")
        prompt = request.prompt
        num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        # before tokenizing: a request too large to ever be admitted costs nothing more
        context.check_num_sequences(num_prompts * request.n, "n" if request.n > 1 else "prompt")
        echo_only = request.max_tokens == 0
        if echo_only and not request.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt).",
                           param="max_tokens")
        prompts = [context.truncate(token_ids, request) for token_ids in await self._prompts(request)]
        # echo with max_tokens 0: one token is computed (the engine always samples one) and dropped
        max_tokens = min(context.check_length(len(p), 1 if echo_only else request.max_tokens, "prompt")
                         for p in prompts)
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None  # echo's
        params = context.build_params(request, max_tokens, request.logprobs, prompt_logprobs)
        params.guided_decoding = guided_decoding_params(request)
        params.output_kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        request_id = random_id("cmpl")
        streams, queue = await context.submit(request_id, prompts, params, request, constraint_renames(request),
                                              lora_request=context.lora_request_for(model_name))
        created = int(time.time())
        if request.stream:
            return stream_response(lambda: self._stream(request, request_id, created, model_name, prompts,
                                                        streams, queue))
        try:
            finals = await until_disconnect(raw_request, self._collect(streams, queue))
        finally:
            abort_all(streams)
        if echo_only:
            finals = [_without_generation(output) for output in finals]
        return JSONResponse(self._response(request, request_id, created, model_name, prompts,
                                           finals).model_dump())

    async def _collect(self, streams: list[RequestStream], queue: OutputQueue,
                       ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in merged_outputs(streams, queue):
            finals[index] = output
        return [output for output in finals if output is not None]

    def _prompt_text(self, request: CompletionRequest, prompt_index: int, output: RequestOutput,
                     prompt_ids: list[int]) -> str:
        """What echo repeats: the prompt as the client sent it, not with the BOS the tokenizer added (the
        kept tokens' text where truncate_prompt_tokens cut it)."""
        if request.truncate_prompt_tokens is not None:
            return self.tokenizer.decode(prompt_ids)
        if isinstance(request.prompt, str):
            return request.prompt
        if request.prompt and isinstance(request.prompt[0], str):
            return request.prompt[prompt_index]  # type: ignore[return-value]
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(prompt_ids)

    def _response(self, request: CompletionRequest, request_id: str, created: int, model_name: str,
                  prompts: list[list[int]], finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        num_generated = 0
        as_ids = self.context.tokens_as_ids(request)
        for prompt_index, output in enumerate(finals):
            prompt_ids = prompts[prompt_index]
            prompt_text = self._prompt_text(request, prompt_index, output, prompt_ids) if request.echo else ""
            for completion in output.outputs:
                num_generated += len(completion.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    offset = len(prompt_text)
                    if request.echo:  # (offsets run on over the prompt's token strings, as vLLM's)
                        offset = self._add_logprobs(logprobs, prompt_ids, output.prompt_logprobs, 0, as_ids)
                    self._add_logprobs(logprobs, completion.token_ids, completion.logprobs, offset, as_ids)
                choices.append(CompletionFinalChoice(
                    index=prompt_index * request.n + completion.index, text=prompt_text + completion.text,
                    logprobs=logprobs, finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(self.tokenizer, output.prompt_logprobs)
                    if request.prompt_logprobs is not None else None))
        choices.sort(key=lambda choice: choice.index)
        num_prompt = sum(len(p) for p in prompts)
        return CompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                                  total_tokens=num_prompt + num_generated),
                                  kv_transfer_params=finals[0].kv_transfer_params if finals else None)

    def _add_logprobs(self, target: CompletionLogProbs, token_ids: list[int],
                      logprobs: list[dict[int, Any]] | None, text_offset: int, as_ids: bool) -> int:
        """Append OpenAI's per-token lists; returns the text offset after the last token. as_ids: tokens
        named "token_id:N"."""
        for position, token_id in enumerate(token_ids):
            step = logprobs[position] if logprobs is not None and position < len(logprobs) else None
            sampled = step.get(token_id) if step else None
            token = decoded(self.tokenizer, token_id, sampled, as_ids)
            target.tokens.append(token)
            target.token_logprobs.append(finite(sampled.logprob) if sampled is not None else None)
            target.top_logprobs.append(self._top_logprobs(step, as_ids) if step else None)
            target.text_offset.append(text_offset)
            text_offset += len(token)
        return text_offset

    def _top_logprobs(self, step: dict[int, Any], as_ids: bool) -> dict[str, float]:
        # keyed by text, as OpenAI does: ids that decode alike (partial UTF-8) keep the likeliest
        top: dict[str, float] = {}
        for token_id, logprob in sorted(step.items(), key=lambda kv: logprob_rank(kv[1])):
            top.setdefault(decoded(self.tokenizer, token_id, logprob, as_ids), finite(logprob.logprob))
        return top

    async def _stream(self, request: CompletionRequest, request_id: str, created: int, model_name: str,
                      prompts: list[list[int]], streams: list[RequestStream],
                      queue: OutputQueue) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        as_ids = self.context.tokens_as_ids(request)
        # DELTA outputs carry the prompt's logprobs once, in a prompt's first output
        prompt_logprobs: dict[int, Any] = {}
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        try:
            async for prompt_index, output in merged_outputs(streams, queue):
                if request.max_tokens == 0:  # echo only
                    output = _without_generation(output)
                prompt_ids = prompts[prompt_index]
                if output.prompt_logprobs is not None:
                    prompt_logprobs.setdefault(prompt_index, output.prompt_logprobs)
                choices = []
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    state = states.setdefault(index, ChoiceState())
                    if state.finished:
                        continue
                    prefix = ""
                    if request.echo and not state.echoed:
                        # the first chunk repeats the prompt
                        prefix = self._prompt_text(request, prompt_index, output, prompt_ids)
                        state.echoed = True
                    delta_text = prefix + completion.text
                    new_ids = completion.token_ids
                    logprobs = None
                    if request.logprobs is not None and (new_ids or prefix):
                        logprobs = CompletionLogProbs()
                        if prefix:
                            state.text_offset = self._add_logprobs(logprobs, prompt_ids,
                                                                   prompt_logprobs.get(prompt_index), 0, as_ids)
                        state.text_offset = self._add_logprobs(logprobs, new_ids, completion.logprobs,
                                                               state.text_offset, as_ids)
                    state.num_tokens += len(new_ids)
                    state.finished = completion.finish_reason is not None
                    if delta_text or new_ids or state.finished:
                        choices.append(CompletionResponseChoice(
                            index=index, text=delta_text, logprobs=logprobs,
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
                if choices:
                    chunk = CompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                     choices=choices)
                    yield sse(chunk.model_dump(exclude_none=False))
            if include_usage:
                num_prompt = sum(len(p) for p in prompts)
                total_generated = sum(state.num_tokens for state in states.values())
                usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=total_generated,
                                  total_tokens=num_prompt + total_generated)
                chunk = CompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                 choices=[], usage=usage)
                yield sse(chunk.model_dump())
        except Exception as exc:  # the stream already started: the error is its last event
            yield stream_error_event(exc, request_id)
        finally:
            # the client went away (this generator was cancelled) or we are done: free the blocks
            abort_all(streams)
        yield SSE_DONE


def _without_generation(output: RequestOutput) -> RequestOutput:
    """An echo-only request's output (max_tokens 0): the token computed to finish it is dropped."""
    return dataclasses.replace(output, outputs=[
        dataclasses.replace(completion, text="", token_ids=[], cumulative_logprob=None,
                            logprobs=[] if completion.logprobs is not None else None)
        for completion in output.outputs])
