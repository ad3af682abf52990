"""Speculative decoding: proposers (draft model, n-gram) and lossless verification."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine


def build_spec_decoder(args: EngineArgs, engine: LLMEngine) -> Any:
    if args.speculative_model is None and not args.speculative_config:
        return None
    raise ValueError("speculative decoding is not available in this build yet.")
