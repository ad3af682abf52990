"""What one forward pass produced (the worker's answer to a SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.distributed.kv_transfer.base import KVConnectorOutput
from pagedllm.outputs import PositionLogprobs


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, per request id."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # accepted + bonus tokens
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    sampled_logprobs: dict[str, list[float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals for the next step
    kv_connector_output: KVConnectorOutput | None = None
    # Seconds the model's forward pass and LM head took on the sampling rank: what a profile of the engine
    # needs when the model runs in another process (the rest of a step is overhead).
    forward_s: float = 0.0
