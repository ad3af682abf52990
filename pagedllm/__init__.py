"""pagedllm: paged-attention LLM inference with vLLM's API."""

import os


def _openmp_wait_policy() -> None:
    """How torch's OpenMP threads wait between parallel regions; read once, when torch loads its OpenMP
    runtime, so it must be set here, before any import of torch. An explicit OMP_WAIT_POLICY or
    GOMP_SPINCOUNT in the environment wins.

    A thread that finishes a region early either spins, ready for the next one, or sleeps and is woken.
    On a machine shared with other jobs spinning competes with them (and can stall a step for seconds);
    on an idle one sleeping costs a wake-up per region, and a decode step is a hundred regions
    (docs/performance/index.md has both measurements). So: sleep when the 1-minute load average says
    other work is running (the default thread count then leaves those CPUs alone too, see
    platform.default_num_threads), else spin briefly (1,000,000 iterations) before sleeping."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    busy = int(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 1
    if busy >= 1:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = "1000000"


_openmp_wait_policy()

from pagedllm.llm import LLM  # noqa: E402
from pagedllm.logger import configure_logging  # noqa: E402
from pagedllm.lora.request import LoRARequest  # noqa: E402
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams  # noqa: E402
from pagedllm.version import __version__  # noqa: E402

configure_logging()

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "LoRARequest", "__version__"]
