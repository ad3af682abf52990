"""pagedllm: paged-attention LLM inference with vLLM's API."""

from pagedllm.openmp import configure_wait_policy

# Before anything imports torch: its OpenMP runtime reads the wait policy once, when it loads.
configure_wait_policy()

from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.inputs import PromptType, TextPrompt, TokensPrompt  # noqa: E402
from pagedllm.llm import LLM  # noqa: E402
from pagedllm.logger import configure_logging  # noqa: E402
from pagedllm.lora.request import LoRARequest  # noqa: E402
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedllm.sampling_params import (  # noqa: E402
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedllm.version import __version__  # noqa: E402

configure_logging()

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "StructuredOutputsParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest", "EngineArgs", "LLMEngine", "PromptType",
           "TextPrompt", "TokensPrompt", "__version__"]
