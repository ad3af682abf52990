"""POST /v1/chat/completions: messages through the tokenizer's chat template, then one engine request.

Streaming follows OpenAI's chunk order: a first delta per choice carrying the role, then content
deltas, then the finish_reason, and with stream_options.include_usage a last chunk with only usage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import OutputQueue, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning
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
from pagedllm.entrypoints.openai.structured_outputs import (
    ToolCallStream,
    constraint_renames,
    guided_decoding_params,
    tool_calls_from_text,
    tool_mode,
)
from pagedllm.entrypoints.openai.tool_parsers import AutoToolStream, parse_tool_calls
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.tokenizer import message_text

# SamplingParams calls the chat API's top_logprobs "logprobs"
_PARAM_RENAMES = {"logprobs": "top_logprobs"}


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    try:
        content = message_text(message.content)  # OpenAI's content parts: only text goes through the template
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(message, key) is not None:
            result[key] = getattr(message, key)
    return result


# apply_chat_template's own arguments: set by the server, never through chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = {"conversation", "tools", "documents", "add_generation_prompt", "tokenize",
                             "padding", "truncation", "max_length", "return_tensors", "return_dict",
                             "return_assistant_tokens_mask", "tokenizer_kwargs", "continue_final_message"}


def chat_template_kwargs(request: ChatCompletionRequest, trust_request_chat_template: bool) -> dict[str, Any]:
    """The request's extra template arguments; 400 for a template of its own unless the operator
    trusts them (--trust-request-chat-template, as in vLLM): a template is code, and Jinja loops
    can run for as long as they like."""
    kwargs = dict(request.chat_template_kwargs or {})
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"chat_template_kwargs may not set {key!r}.", param="chat_template_kwargs")
    for param, template in (("chat_template", request.chat_template),
                            ("chat_template_kwargs", kwargs.get("chat_template"))):
        if template is None:
            continue
        if not trust_request_chat_template:
            raise APIError(400, "This server does not accept chat templates in requests; the operator "
                           "can allow them with --trust-request-chat-template.", param=param)
        if not isinstance(template, str):
            raise APIError(400, "chat_template must be a string.", param=param)
        kwargs["chat_template"] = template
    return kwargs


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                       template_kwargs: dict[str, Any] | None,
                       tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> str:
    """The prompt text the chat template makes of the messages; 400 if the template refuses them.
    Runs on a tokenizer worker thread (ServingContext.encode_chat), not on the event loop."""
    if getattr(tokenizer, "chat_template", None) is None and not (template_kwargs or {}).get("chat_template"):
        raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.",
                       param="messages")
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (continuing "
                       "the last message opens no new turn).", param="continue_final_message")
    try:
        return tokenizer.apply_chat_template(
            [_message_dict(message) for message in messages], add_generation_prompt=add_generation_prompt,
            tokenize=False, continue_final_message=continue_final_message, **({"tools": tools} if tools else {}),
            **(template_kwargs or {}))
    except APIError:
        raise
    except Exception as exc:  # jinja raises for messages the template does not accept
        raise APIError(400, f"The chat template rejected the messages: {type(exc).__name__}",
                       param="messages") from exc


def messages_chars(messages: list[ChatMessage]) -> int:
    """The text length of the messages, checked before the template renders them."""
    total = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content if isinstance(part.get("text"), str))
    return total


class OpenAIServingChat:
    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.tokenizer = context.tokenizer

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        context = self.context
        model_name = context.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options can only be given when stream is true.",
                           param="stream_options")
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        template_kwargs = chat_template_kwargs(request, context.trust_request_chat_template)
        context.check_prompt_chars(messages_chars(request.messages), "messages")
        # the tool definitions go to the chat template, which shows them to models trained on tool use
        tools = [tool.model_dump() for tool in request.tools] if request.tools else None
        prompt_ids = await context.encode_chat(lambda tokenizer: render_chat_prompt(
            tokenizer, request.messages, request.add_generation_prompt, template_kwargs, tools,
            request.continue_final_message))
        prompt_ids = context.truncate(prompt_ids, request)
        if not prompt_ids:
            raise APIError(400, "The chat template produced an empty prompt.", param="messages")
        requested = request.max_completion_tokens or request.max_tokens
        max_tokens = context.check_length(
            len(prompt_ids), requested, "messages",
            "max_completion_tokens" if request.max_completion_tokens else "max_tokens")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        renames = {**_PARAM_RENAMES, "max_tokens": "max_completion_tokens"} \
            if request.max_completion_tokens else _PARAM_RENAMES
        params = context.build_params(request, max_tokens, logprobs, request.prompt_logprobs, renames=renames)
        tools_mode = tool_mode(request, context.tool_call_parser is not None)
        params.guided_decoding = guided_decoding_params(request, tools_mode)
        # (a constrained reply is written by the grammar from its first token: it holds no thinking)
        reasoning = context.reasoning_parser if params.guided_decoding is None else None
        # a stream takes what is new each step (DELTA); a plain request one output at the end
        params.output_kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        request_id = random_id("chatcmpl")
        streams, queue = await context.submit(request_id, [prompt_ids], params, request,
                                              {**renames, **constraint_renames(request)},
                                              lora_request=context.lora_request_for(model_name))
        created = int(time.time())
        if request.stream:
            return stream_response(lambda: self._stream(request, request_id, created, model_name,
                                                        len(prompt_ids), streams, queue, tools_mode, reasoning))
        try:
            final = await until_disconnect(raw_request, self._collect(streams, queue))
        finally:
            abort_all(streams)
        return JSONResponse(self._response(request, request_id, created, model_name, len(prompt_ids),
                                           final, tools_mode, reasoning).model_dump())

    async def _collect(self, streams: list[RequestStream], queue: OutputQueue) -> RequestOutput:
        final = None
        async for _, output in merged_outputs(streams, queue):
            final = output
        assert final is not None, "a finished stream always ends with an output"
        return final

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  logprobs: list[dict[int, Any]] | None) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0
        as_ids = self.context.tokens_as_ids(request)
        content = []
        for position, token_id in enumerate(token_ids):
            step = logprobs[position] if logprobs is not None and position < len(logprobs) else {}
            sampled = step.get(token_id)
            token = decoded(self.tokenizer, token_id, sampled, as_ids)
            ranked = sorted(step.items(), key=lambda kv: logprob_rank(kv[1]))
            top = [ChatCompletionLogProb(token=(top_token := decoded(self.tokenizer, tid, lp, as_ids)),
                                         logprob=finite(lp.logprob),
                                         bytes=list(top_token.encode("utf-8", errors="replace")))
                   for tid, lp in ranked[:num_top]]
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=finite(sampled.logprob) if sampled else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _response(self, request: ChatCompletionRequest, request_id: str, created: int, model_name: str,
                  num_prompt_tokens: int, final: RequestOutput, tools_mode: str | None,
                  reasoning: str | None) -> ChatCompletionResponse:
        echoed = _echoed_text(request, tools_mode)
        role = self.context.response_role
        choices = []
        for completion in final.outputs:
            text, thought = completion.text, None
            if reasoning is not None:  # the thinking apart (--reasoning-parser)
                thought, text = split_reasoning(reasoning, text)
                text = text or ""
            content: str | None = echoed + text
            if thought is not None and not content:
                content = None  # a reply that only thought
            message = ChatResponseMessage(role=role, content=content, reasoning_content=thought)
            finish_reason = completion.finish_reason
            if tools_mode == "auto":  # the model's own calls, as the parser reads them from its text
                content, tool_calls = parse_tool_calls(text)
                if tool_calls:
                    message = ChatResponseMessage(role=role, content=content, tool_calls=tool_calls,
                                                  reasoning_content=thought)
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            elif tools_mode is not None:
                tool_calls = tool_calls_from_text(request, completion.text)
                if tool_calls:  # a complete call: OpenAI's shape, content null
                    message = ChatResponseMessage(role=role, content=None, tool_calls=tool_calls)
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices.append(ChatCompletionResponseChoice(
                index=completion.index, message=message,
                logprobs=self._logprobs(request, completion.token_ids, completion.logprobs),
                finish_reason=finish_reason, stop_reason=completion.stop_reason))
        choices.sort(key=lambda choice: choice.index)
        num_generated = sum(len(completion.token_ids) for completion in final.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                            total_tokens=num_prompt_tokens + num_generated),
            prompt_logprobs=prompt_logprobs_json(self.tokenizer, final.prompt_logprobs)
            if request.prompt_logprobs is not None else None,
            kv_transfer_params=final.kv_transfer_params)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int, model_name: str,
                      num_prompt_tokens: int, streams: list[RequestStream],
                      queue: OutputQueue, tools_mode: str | None, reasoning: str | None) -> AsyncIterator[str]:
        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            payload = ChatCompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                   choices=choices, usage=usage).model_dump()
            for choice, model in zip(payload["choices"], choices):  # as OpenAI: a delta carries only what it has
                choice["delta"] = model.delta.model_dump(exclude_none=True)
            return sse(payload)

        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        states = [ChoiceState() for _ in range(request.n)]
        tool_streams = [ToolCallStream(request) for _ in range(request.n)] \
            if tools_mode in ("named", "required") else None
        auto_streams = [AutoToolStream() for _ in range(request.n)] if tools_mode == "auto" else None
        thoughts = [ReasoningStream(reasoning) for _ in range(request.n)] if reasoning is not None else None
        try:
            # the role comes first, before any token, as OpenAI's stream does (with echo, the echoed text)
            echoed, role = _echoed_text(request, tools_mode), self.context.response_role
            yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=role,
                                                                                        content=echoed))
                         for i in range(request.n)])
            async for _, output in merged_outputs(streams, queue):
                choices = []
                for completion in output.outputs:
                    state = states[completion.index]
                    if state.finished:
                        continue
                    delta_text = completion.text
                    new_ids = completion.token_ids
                    new_logprobs = completion.logprobs
                    state.num_tokens += len(new_ids)
                    state.finished = completion.finish_reason is not None
                    thought = ""
                    if thoughts is not None:  # the thinking apart (--reasoning-parser)
                        thought, delta_text = thoughts[completion.index].add(delta_text, final=state.finished)
                    delta = DeltaMessage(content=delta_text, reasoning_content=thought or None)
                    finish_reason = completion.finish_reason
                    if tool_streams is not None:  # the text is a tool call: sent as tool_calls deltas
                        tool_stream = tool_streams[completion.index]
                        delta = DeltaMessage(tool_calls=tool_stream.add(delta_text) or None)
                        if finish_reason == "stop" and tool_stream.num_calls:
                            finish_reason = "tool_calls"
                    elif auto_streams is not None:  # text, then the calls the parser finds in it
                        auto_stream = auto_streams[completion.index]
                        content, calls = auto_stream.add(delta_text, final=state.finished)
                        delta = DeltaMessage(content=content or None, tool_calls=calls or None,
                                             reasoning_content=thought or None)
                        if finish_reason == "stop" and auto_stream.num_calls:
                            finish_reason = "tool_calls"
                    # a tool call's tokens that complete nothing yet send no empty delta (unless logprobs)
                    has_news = (delta.content or delta.tool_calls or delta.reasoning_content
                                or (request.logprobs and new_ids)) \
                        if tool_streams is not None or auto_streams is not None or thoughts is not None \
                        else (delta_text or new_ids)
                    if has_news or state.finished:
                        choices.append(ChatCompletionResponseStreamChoice(
                            index=completion.index, delta=delta,
                            logprobs=self._logprobs(request, new_ids, new_logprobs),
                            finish_reason=finish_reason, stop_reason=completion.stop_reason))
                if choices:
                    yield chunk(choices)
            if include_usage:
                total = sum(state.num_tokens for state in states)
                yield chunk([], UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=total,
                                          total_tokens=num_prompt_tokens + total))
        except Exception as exc:  # the stream already started: the error is its last event
            yield stream_error_event(exc, request_id)
        finally:
            abort_all(streams)
        yield SSE_DONE


def _echoed_text(request: ChatCompletionRequest, tools_mode: str | None) -> str:
    """With echo (vLLM's), the text a reply starts with: the last message's, where it is the assistant's."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant" or tools_mode is not None:
        return ""
    return message_text(last.content)
