"""Structured outputs on the server: response_format, vLLM's guided_* extras, and tool calls.

A request names at most one constraint: response_format ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}; "text" is none), guided_json, guided_regex,
guided_choice or guided_grammar, or, on chat, tools with tool_choice. A named function or "required"
constrains the output to the function's arguments schema (for "required", to a JSON list of calls, each
one of the tools: vLLM's format) and the answer carries OpenAI's `tool_calls`. "auto" constrains nothing: the
model decides, and with the server's --enable-auto-tool-choice a tool-call parser reads its calls from
its text (tool_parsers.py); without it, "auto" is a 400.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    SamplingRequestFields,
    ToolCall,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import APIError
from pagedllm.sampling_params import GuidedDecodingParams

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _make(param: str, request: SamplingRequestFields, **kind: Any) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams(whitespace_pattern=request.guided_whitespace_pattern,
                                    whitespace_flexible=bool(request.guided_whitespace_flexible),
                                    backend=request.guided_decoding_backend, **kind)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from exc


# vLLM's guided_* fields and the constraint kind each gives
_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"))
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def constraint_renames(request: SamplingRequestFields) -> dict[str, str]:
    """The engine names a constraint it refuses by its kind ("regex exceeds ..."): the request's field that
    gave it, for the 400's param."""
    for name in (*(guided for guided, _ in _GUIDED_FIELDS), "structured_outputs", "response_format", "tools"):
        if getattr(request, name, None) is not None:
            return dict.fromkeys(_KINDS, name)
    return {}


def guided_decoding_params(request: SamplingRequestFields, tools: str | None = None) -> GuidedDecodingParams | None:
    """The constraint of response_format, a guided_* field or a forced tool call (`tools`: the chat
    request's tool_mode); 400 naming the field if bad or several."""
    given: list[tuple[str, dict[str, Any]]] = []
    if tools in ("named", "required"):
        given.append(("tools", {"json": tool_schema(request)}))
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        else:
            schema = response_format.json_schema.json_schema if response_format.json_schema else None
            if schema is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema.",
                               param="response_format")
            given.append(("response_format", {"json": schema}))
    for name, kind in _GUIDED_FIELDS:
        value = getattr(request, name)
        if value is not None:
            given.append((name, {kind: value}))
    if request.structured_outputs is not None:
        given.append(("structured_outputs", request.structured_outputs))
    if not given:
        for name in ("guided_whitespace_pattern", "guided_whitespace_flexible", "guided_decoding_backend"):
            if getattr(request, name) is not None:
                raise APIError(400, f"{name} needs a constraint (response_format or a guided_* field).",
                               param=name)
        return None
    if len(given) > 1:
        names = [name for name, _ in given]
        raise APIError(400, f"Only one structured-output constraint can be given, got {names}.", param=names[1])
    param, kind = given[0]
    if param == "structured_outputs":
        return _structured_outputs(request.structured_outputs)
    return _make(param, request, **kind)


def _structured_outputs(fields: dict[str, Any]) -> GuidedDecodingParams:
    """vLLM's structured_outputs object: GuidedDecodingParams' fields (any other key is a 400 naming it)."""
    known = {f.name for f in dataclasses.fields(GuidedDecodingParams)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise APIError(400, f"structured_outputs has no field {unknown[0]!r}; it takes {sorted(known)}.",
                       param="structured_outputs")
    try:
        return GuidedDecodingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"structured_outputs: {exc}", param="structured_outputs") from exc


# ---- tools -------------------------------------------------------------------------------------------


def tool_mode(request: ChatCompletionRequest, auto_tools: bool = False) -> str | None:
    """"named", "required" (a call is forced: the grammar writes it), "auto" (the model decides and a
    tool-call parser reads its text; only with auto_tools, the server's --enable-auto-tool-choice), or
    None; 400 for bad combinations."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools.", param="tool_choice")
        return None
    if choice is None or choice == "auto":
        if auto_tools:
            return "auto"
        raise APIError(400, 'tool_choice "auto" needs a tool-call parser: start the server with '
                       "--enable-auto-tool-choice --tool-call-parser hermes (as vLLM), or name a function, "
                       'use "required" or "none".', param="tool_choice")
    if choice == "none":
        return None
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        if choice.function.name not in {tool.function.name for tool in request.tools}:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not among "
                           "the tools.", param="tool_choice")
        return "named"
    return "required"


def tool_schema(request: ChatCompletionRequest) -> dict[str, Any]:
    assert request.tools
    if isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam):
        tool = next(t for t in request.tools if t.function.name == request.tool_choice.function.name)
        return tool.function.parameters or _EMPTY_PARAMETERS
    # "required": a list of calls, each naming one tool and giving arguments in its schema (vLLM's format;
    # closed objects, so a call ends after its two keys instead of collecting arbitrary extra ones)
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                               "parameters": tool.function.parameters or _EMPTY_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in request.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def tool_calls_from_text(request: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """OpenAI's tool_calls for a finished output, or None if the text is not a complete call (cut by
    max_tokens or a stop string)."""
    if isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam):
        try:
            json.loads(text)
        except ValueError:
            return None
        return [ToolCall(function=FunctionCall(name=request.tool_choice.function.name, arguments=text))]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    # the arguments as a stream sends them: each call's parameters text as written
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in ToolCallStream(request).add(text):
        if delta.function.name is not None:
            names[delta.index] = delta.function.name
        arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    return [ToolCall(function=FunctionCall(name=names[i], arguments=arguments[i])) for i in sorted(names)]


@dataclass
class ToolCallStream:
    """Turns one choice's growing text into OpenAI's streamed tool_calls deltas: a call's first delta has
    its id, type and name, the later ones its arguments text as it comes.

    Named function: the whole text is the arguments. "required": a list of {"name", "parameters"} objects
    (the grammar writes the name first); each call's arguments are its parameters' text, sent as they grow
    (a call whose keys come the other way round is sent whole once complete).
    """

    request: ChatCompletionRequest
    text: str = ""
    num_calls: int = 0  # calls complete so far
    scan_pos: int = 0  # where the next call may start
    args_start: int | None = None  # the current call's parameters, once its name is sent
    args_sent: int = 0
    ids: list[str] = field(default_factory=list)

    def add(self, delta_text: str) -> list[DeltaToolCall]:
        self.text += delta_text
        choice = self.request.tool_choice
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            if not self.ids:
                self.num_calls = 1
                self.ids.append(random_id("chatcmpl-tool"))
                return [DeltaToolCall(index=0, id=self.ids[0], type="function",
                                      function=DeltaFunctionCall(name=choice.function.name, arguments=delta_text))]
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))] if delta_text else []
        return self._listed_calls()

    def _start_call(self, name: str, arguments: str) -> DeltaToolCall:
        self.ids.append(random_id("chatcmpl-tool"))
        return DeltaToolCall(index=self.num_calls, id=self.ids[-1], type="function",
                             function=DeltaFunctionCall(name=name, arguments=arguments))

    def _listed_calls(self) -> list[DeltaToolCall]:
        text, decoder, deltas = self.text, json.JSONDecoder(), []
        while True:
            if self.args_start is None:  # between calls
                pos = self.scan_pos
                while pos < len(text) and text[pos] in " \t\r\n,[":
                    pos += 1
                if pos >= len(text) or text[pos] != "{":
                    return deltas
                head = _CALL_HEAD.match(text, pos)
                if head is None:  # not this far yet, or its keys the other way round: wait for the whole call
                    try:
                        call, self.scan_pos = decoder.raw_decode(text, pos)
                    except ValueError:
                        return deltas
                    if isinstance(call, dict) and "name" in call:
                        deltas.append(self._start_call(call["name"], json.dumps(call.get("parameters", {}),
                                                                                 ensure_ascii=False)))
                        self.num_calls += 1
                    continue
                deltas.append(self._start_call(json.loads(head.group(1)), ""))
                self.args_start = self.args_sent = head.end()
            try:
                _, args_end = decoder.raw_decode(text, self.args_start)
                complete = True
            except ValueError:  # the parameters so far
                args_end, complete = len(text), False
            if args_end > self.args_sent:
                more = text[self.args_sent:args_end]
                if deltas and deltas[-1].index == self.num_calls:  # one entry per call in a chunk
                    deltas[-1].function.arguments = (deltas[-1].function.arguments or "") + more
                else:
                    deltas.append(DeltaToolCall(index=self.num_calls, function=DeltaFunctionCall(arguments=more)))
                self.args_sent = args_end
            close = _CALL_CLOSE.match(text, args_end) if complete else None
            if close is None:
                return deltas
            self.scan_pos, self.args_start = close.end(), None
            self.num_calls += 1


# a listed call's head as the grammar writes it, up to its parameters' value (once its first character is
# there: whitespace may still follow); and its closing brace
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(?=\S)')
_CALL_CLOSE = re.compile(r"\s*\}")
