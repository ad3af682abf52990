"""`tool_choice: "auto"` (vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`): the model decides
whether to call a tool, and its text says so in the format it was trained on; a parser finds the calls.

"hermes" (Hermes, Qwen 2.5 and 3, and the many models trained on their template): each call is a JSON
object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>. The reply's content is
the text before the first call (none if it is empty); a call whose JSON does not parse leaves the whole
text as content, as vLLM's parser does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.protocol import DeltaToolCall, ToolCall

# (the protocol's models are imported where a reply is parsed: `serve`'s flags read this module's names)
TOOL_CALL_PARSERS = ("hermes",)
_START, _END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(_START) + r"(.*?)" + re.escape(_END), re.S)


def _call_fields(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's text, or None if it is not a call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply."""
    from pagedllm.entrypoints.openai.protocol import FunctionCall, ToolCall

    calls = []
    for match in _CALL.finditer(text):
        fields = _call_fields(match.group(1))
        if fields is None:
            return text, []
        calls.append(ToolCall(function=FunctionCall(name=fields[0], arguments=fields[1])))
    if not calls:
        return text, []
    return text[:text.index(_START)] or None, calls


@dataclass
class AutoToolStream:
    """One streamed choice's text split into content deltas and tool-call deltas (each call sent whole,
    id, name and arguments, when its closing tag arrives). Text that may be the start of a <tool_call>
    tag is held back until it is known not to be; after the first call, only calls are sent."""

    text: str = ""
    sent: int = 0  # content sent up to here
    in_calls: bool = False  # the first <tool_call> has come
    num_calls: int = 0
    ids: list[str] = field(default_factory=list)

    def add(self, delta_text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        from pagedllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, random_id

        self.text += delta_text
        content, deltas = "", []
        if not self.in_calls:
            start = self.text.find(_START, self.sent)
            if start < 0:
                end = len(self.text) if final else len(self.text) - tag_prefix_len(self.text, self.sent, _START)
                content, self.sent = self.text[self.sent:end], max(self.sent, end)
                return content, deltas
            content, self.sent, self.in_calls = self.text[self.sent:start], start, True
        for match in _CALL.finditer(self.text, self.sent):
            fields = _call_fields(match.group(1))
            self.sent = match.end()
            if fields is None:
                continue
            self.ids.append(random_id("chatcmpl-tool"))
            deltas.append(DeltaToolCall(index=self.num_calls, id=self.ids[-1], type="function",
                                        function=DeltaFunctionCall(name=fields[0], arguments=fields[1])))
            self.num_calls += 1
        if final and not self.num_calls:  # a tag that never closed on a call: the text was the reply
            content += self.text[self.sent:]
            self.sent = len(self.text)
        return content, deltas


def tag_prefix_len(text: str, start: int, tag: str) -> int:
    """How many characters at text's end (from `start` on) could begin `tag`: text a stream holds back."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
