"""Request and response bodies of the OpenAI API (the subset vLLM serves), as pydantic models.

Pydantic checks types and simple ranges at the boundary; value checks that depend on the model
(context length, vocabulary) stay with the engine, whose ValueError names the field.
Unknown request fields are ignored, as OpenAI clients send fields that a server may not know.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedllm.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _check_unicode(value: Any) -> Any:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or UTF-8 writer accepts."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("contains a lone UTF-16 surrogate (such as \\ud800), which is not "
                                 "valid Unicode text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item)
    return value


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body: every text field must be valid Unicode (400 naming the field otherwise)."""

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return _check_unicode(value)


# --- errors -----------------------------------------------------------------------------------

class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --- shared pieces ----------------------------------------------------------------------------

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaResponseFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    # "schema" shadows a pydantic BaseModel attribute, hence the alias (as vLLM does)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class SamplingRequestFields(OpenAIRequestModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI's and vLLM's)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # the range of a torch generator's seed (an int64); larger values would fail inside the engine
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # OpenAI's token id (a string in JSON) -> bias in [-100, 100]; vLLM's allowed_token_ids
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # vLLM's: words never generated
    # vLLM's: logprobs name their tokens "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's, refused unless they ask nothing (build_params): no beam search, no priority scheduling here
    use_beam_search: bool = False
    priority: int = 0
    # vLLM's: each prompt token's logprob and the top k at its position, in the response (not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # structured outputs: OpenAI's response_format and vLLM's guided_* extras (one of them at a time)
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's newer spelling of the guided_* fields: {"json" | "regex" | "choice" | "grammar" | "json_object":
    # ..., and the whitespace options}
    structured_outputs: dict[str, Any] | None = None
    guided_whitespace_pattern: str | None = None
    # JSON constraints write compact JSON (one space after ":" and ","); true allows JSON's free whitespace
    guided_whitespace_flexible: bool | None = None
    # disaggregated prefill (vLLM's field): {"do_remote_decode": true} asks a KV producer to keep the
    # prompt's blocks; the params its response returns make a KV consumer pull them
    kv_transfer_params: dict[str, Any] | None = None

    def build_sampling_params(self, max_tokens: int, logprobs: int | None,
                              prompt_logprobs: int | None = None,
                              defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams raises ValueError naming the field for values out of range. `defaults` (the
        model's generation config) fill the fields the request left unset; set fields always win."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        optional: dict[str, Any] = {
            name: value for name, value in (defaults or {}).items()
            if name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        optional |= {
            name: value for name, value in (
                ("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                ("min_p", self.min_p), ("repetition_penalty", self.repetition_penalty),
            ) if value is not None
        }
        return SamplingParams(
            n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            **optional,
        )


# --- /v1/completions --------------------------------------------------------------------------

class CompletionRequest(SamplingRequestFields):
    # order matters: pydantic tries the list forms before coercing anything to a string
    prompt: list[int] | list[list[int]] | list[str] | str
    # 0 only with echo: the prompt scored, nothing generated (vLLM's; lm-eval's loglikelihood requests)
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob as its prompt_logprobs serialize it."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt position (None for the first): token id -> its logprob (the prompt's token and the top k)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionFinalChoice(CompletionResponseChoice):
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the prompt_logprobs field


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionFinalChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions ---------------------------------------------------------------------

class ChatMessage(OpenAIRequestModel):
    role: str
    # content parts ([{"type": "text", "text": ...}]) are flattened to text before templating
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # earlier turns of a tool conversation, handed to the chat template as OpenAI sends them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


class ChatCompletionRequest(SamplingRequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # vLLM's: extend the last message (a started assistant reply) instead of opening a new turn; needs
    # add_generation_prompt false
    continue_final_message: bool = False
    # vLLM's: the reply starts with the last message's text where that message is the assistant's
    echo: bool = False
    # a request-supplied template runs arbitrary Jinja: refused unless --trust-request-chat-template
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = True


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # vLLM's, with --reasoning-parser


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the prompt_logprobs field
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# --- models, tokenizer ------------------------------------------------------------------------

class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIRequestModel):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
