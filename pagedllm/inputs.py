"""vLLM's prompt types (`vllm.inputs`): what LLM.generate takes for one prompt."""

from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (with its text, where the caller has it, for RequestOutput.prompt)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
