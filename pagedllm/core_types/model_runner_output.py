"""What one forward pass produced (the worker's answer to a SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.distributed.kv_transfer.base import KVConnectorOutput
from pagedllm.outputs import PositionLogprobs


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced: the sampled tokens in the plan's order (as vLLM V1's runner gives
    them), the rarer results by request id."""

    # sampled_token_ids[i]: the tokens the plan's request i sampled (accepted proposals and the bonus
    # token; none where it computed a prompt chunk only); an empty list: the step sampled nothing
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    sampled_logprobs: dict[str, list[float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals for the next step
    kv_connector_output: KVConnectorOutput | None = None
    # Where the step's time went on the sampling rank, for a profile of the engine (benchmarks/profile.py),
    # in process or not: applying the plan and building the inputs; the model's forward pass and LM head;
    # sampling and keeping the sampled tokens (the rest of a step is overhead).
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
