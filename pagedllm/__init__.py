"""pagedllm: paged-attention LLM inference with vLLM's API."""

from pagedllm.llm import LLM
from pagedllm.logger import configure_logging
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.version import __version__

configure_logging()

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
