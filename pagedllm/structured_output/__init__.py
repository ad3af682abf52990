"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice list or grammar.

As in vLLM's V1 engine: the scheduler asks the StructuredOutputManager for one bitmask per step over the
rows that need it (one per sampled position: 1, or k+1 with speculative tokens); the model runner hands
the sampler that tensor, which masks the logits in one batched fill. Matchers advance on the tokens a
request actually accepted, so preemption, parallel sampling and rejected drafts need no special care.
The grammar library is llguidance (chosen by measurement on the demo tokenizer; see grammar.py).
"""

from pagedllm.structured_output.manager import GrammarBitmask, StructuredOutputManager

__all__ = ["GrammarBitmask", "StructuredOutputManager"]
