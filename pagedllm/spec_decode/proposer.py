"""The one contract every proposer keeps (n-gram, suffix tree, draft model), so SpecDecoder drives them
all alike without knowing which it has. An EAGLE-style head would be one more class: KV in the target's
blocks as the draft model's, and the target's last hidden states as one more ProposeInput field.

Each step, after the target sampled, SpecDecoder hands the proposer a ProposeInput: the requests that
propose (their tokens with this step's sampled ones, and how many tokens each may propose) and the
scheduled requests that propose nothing this step (a proposer that keeps KV computes their new tokens
too, so its cache never falls behind the target's). The proposer returns its proposals, each with the
distribution it was drawn from where it sampled (q, which lossless verification of an unseeded request
needs), or None where it proposes deterministically.

A proposer that keeps KV (a draft model, an EAGLE head) keeps it in the target's blocks: the one KV
cache manager allocates them (vLLM V1's layout, the draft's layers beside the target's in each block),
with `num_lookahead_tokens` slots past a request's scheduled tokens for the positions of its drafts, and
frees them with the request. The proposer only sizes its cache tensors per block.

A leaf: the worker hands a draft model's runner in through the DraftRunner interface, so spec_decode/
never imports the worker (the worker imports spec_decode, as in vLLM V1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedllm.core_types.scheduler_output import ScheduledRequest
    from pagedllm.layers.sampler import SamplingRow


@dataclass
class DraftRequest:
    """A request as the proposers see it at the end of a step: its tokens with this step's sampled ones."""

    request_id: str
    all_token_ids: list[int]
    sampling_params: SamplingParams
    num_prompt_tokens: int = 0
    # The target's computed tokens before this step (the first position its step wrote): a proposer
    # keeping KV in the target's blocks may trust only what lies in blocks the request held since.
    num_computed_tokens: int = 0


# A proposal: the draft tokens, and the [k, V] distribution they were drawn from (None: deterministic,
# or a greedy/seeded request, whose verification needs only the tokens).
Proposal = tuple[list[int], "torch.Tensor | None"]


@dataclass
class ProposeInput:
    """One step's work for a proposer."""

    requests: list[DraftRequest]                        # the requests that propose
    num_spec_tokens: list[int]                          # the most tokens requests[i] may propose (>= 1)
    sampling_rows: list[SamplingRow]                    # requests[i]'s sampling row (what a sampled draft follows)
    catch_up: list[DraftRequest] = field(default_factory=list)  # scheduled, proposing nothing this step
    max_catch_up_tokens: int | None = None              # the most tokens a KV-keeping proposer's first pass computes


class Proposer(Protocol):
    """What SpecDecoder asks of a proposer."""

    # A proposal costs next to nothing (no model): k may adapt down to 0 and back.
    model_free: bool
    # Its proposals are drawn from a distribution (returned as q for every unseeded sampled request).
    samples_drafts: bool

    def kv_cache_bytes_per_block(self) -> int:
        """What the proposer's own KV adds to each of the target's blocks (0: it keeps none)."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Its cache tensors for the target's num_blocks blocks (nothing without KV)."""
        ...

    def cost_per_token(self, target_num_layers: int, target_weight_bytes: int) -> float:
        """A proposed token's cost relative to a target pass (adaptive k of a draft model)."""
        ...

    def propose(self, inputs: ProposeInput) -> dict[str, Proposal]: ...

    def free(self, request_ids: set[str]) -> None:
        """Forget requests that left the running set (finished, aborted, preempted)."""
        ...


class ModelFreeProposer:
    """The defaults of a proposer that reads only the requests' tokens (n-gram, suffix tree)."""

    model_free = True
    samples_drafts = False

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def cost_per_token(self, target_num_layers: int, target_weight_bytes: int) -> float:
        return 0.0

    def free(self, request_ids: set[str]) -> None:
        pass


class DraftRunner(Protocol):
    """The draft model's runner, as DraftModelProposer drives it: its KV cache tensors (one block per
    target block; it reads the target's block tables), prepare + forward of a plan, and the model's
    logits. The worker's ModelRunner is one."""

    model_config: ModelConfig
    cache_config: CacheConfig
    block_size: int
    model: Any         # argmax_logits(hidden) and compute_logits(hidden)
    sampler: Any       # its `generator` (unseeded random draws)
    kv_caches: list[torch.Tensor]

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def kv_cache_bytes_per_block(self) -> int: ...

    def weight_bytes(self) -> int: ...

    def prepare(self, scheduled: list[ScheduledRequest]) -> Any: ...  # a batch for forward()

    def forward(self, batch: Any) -> torch.Tensor: ...
