"""pagedllm: paged-attention LLM inference with vLLM's API."""

import os

# OpenMP threads that finish a parallel region early spin, waiting for the others; on a machine
# shared with other jobs they spin against them. Measured on 2 cores with one busy-loop competitor
# (32 prompts x 128 tokens, output tok/s): 2 torch threads gave 58, 46 and three 300 s timeouts with
# GNU OpenMP's default wait policy, 83/23/<14 with ACTIVE and 601/404/634/115/236/103 with PASSIVE, where
# 1 thread gave 58-577 as the other load varied. It must be set before torch loads its OpenMP runtime,
# hence here, before any import of torch; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedllm.llm import LLM  # noqa: E402
from pagedllm.logger import configure_logging  # noqa: E402
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams  # noqa: E402
from pagedllm.version import __version__  # noqa: E402

configure_logging()

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]
