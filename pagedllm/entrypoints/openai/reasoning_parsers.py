"""vLLM's `--reasoning-parser NAME`: a thinking model's reasoning, written between <think> and </think>,
comes back as the message's `reasoning_content`, apart from its `content`.

- "deepseek_r1": the reasoning runs from the start (an opening <think> is dropped) to </think>; a reply
  that never closes it is all reasoning (it was cut, or still thinking).
- "qwen3": the reasoning is there only where the reply opens with <think> and closes it; any other reply
  is all content (Qwen3 with thinking turned off). Streamed, a reply that opens the tag sends reasoning
  deltas at once, so one cut before </think> has sent reasoning that the whole reply would call content
  (as vLLM's parser does).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.tool_parsers import tag_prefix_len

REASONING_PARSERS = ("deepseek_r1", "qwen3")
_OPEN, _CLOSE = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished reply; None where there is none."""
    opened = text.startswith(_OPEN)
    body = text[len(_OPEN):] if opened else text
    end = body.find(_CLOSE)
    if parser == "qwen3" and (end < 0 or not opened):
        return None, text or None
    if end < 0:
        return body or None, None
    return body[:end] or None, body[end + len(_CLOSE):] or None


@dataclass
class ReasoningStream:
    """One streamed choice's text split into reasoning and content deltas as it comes: a possible tag is
    held back until it is known, so neither side ever shows part of one."""

    parser: str
    text: str = ""
    sent: int = 0  # text sent (either side) up to here
    mode: str | None = None  # "reasoning", then "content"; None until the start is known

    def add(self, delta_text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        self.text += delta_text
        reasoning = content = ""
        if self.mode is None:
            if self.text.startswith(_OPEN):
                self.mode, self.sent = "reasoning", len(_OPEN)
            elif _OPEN.startswith(self.text) and not final:
                return "", ""  # it may still open with the tag
            else:
                # without the opening tag: deepseek_r1 reads reasoning up to </think>, qwen3 content only
                self.mode = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.mode == "reasoning":
            end = self.text.find(_CLOSE, self.sent)
            if end < 0:
                stop = len(self.text) if final else len(self.text) - tag_prefix_len(self.text, self.sent, _CLOSE)
                reasoning, self.sent = self.text[self.sent:stop], max(self.sent, stop)
                return reasoning, ""
            reasoning, self.sent, self.mode = self.text[self.sent:end], end + len(_CLOSE), "content"
        content, self.sent = self.text[self.sent:], len(self.text)
        return reasoning, content
