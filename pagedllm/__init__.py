"""pagedllm: paged-attention LLM inference with vLLM's API."""

from pagedllm.llm import LLM
from pagedllm.logger import configure_logging
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import GuidedDecodingParams, SamplingParams
from pagedllm.version import __version__

configure_logging()

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "__version__"]
