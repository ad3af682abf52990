"""The one per-step context a model's layers read besides their inputs (nano-vllm and vLLM keep theirs the
same way): which rows of the step's flat batch are prompt tokens. The model runner sets it around the
forward pass (`use`); a layer asks `prompt_rows()`, which is None outside a forward pass and in a step
with no prompt row.

Why a layer would care: a weight-only quantized linear computes prompt rows by another arithmetic than
generated ones where that is faster (a prefill chunk on bf16 tiles: layers/quantization/vnni.py). A
row's path must follow from what the row is, a position before its request's prompt ends, never from
the batch it lands in, or outputs would depend on chunk sizes, batch composition or prefix-cache hits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSplit:
    """The step's rows by kind: `prompt` and `other` index the flat batch of `num_rows` rows (slices where
    the rows are one run, which index without a copy); `other` is None when every row is a prompt row."""

    num_rows: int
    prompt: slice | torch.Tensor
    other: slice | torch.Tensor | None

    @classmethod
    def from_runs(cls, num_rows: int, runs: Sequence[tuple[int, int]]) -> RowSplit | None:
        """From the prompt rows as runs [start, stop), in order and disjoint; None when there are none."""
        merged: list[list[int]] = []
        for start, stop in runs:
            if stop <= start:
                continue
            if merged and merged[-1][1] == start:
                merged[-1][1] = stop
            else:
                merged.append([start, stop])
        if not merged:
            return None
        if len(merged) == 1:
            start, stop = merged[0]
            if start == 0 and stop == num_rows:
                return cls(num_rows, slice(0, num_rows), None)
            if start == 0 or stop == num_rows:  # the other rows are one run too
                return cls(num_rows, slice(start, stop), slice(stop, num_rows) if start == 0 else slice(0, start))
        is_prompt = torch.zeros(num_rows, dtype=torch.bool)
        for start, stop in merged:
            is_prompt[start:stop] = True
        return cls(num_rows, is_prompt.nonzero().flatten(), (~is_prompt).nonzero().flatten())


_prompt_rows: RowSplit | None = None


def prompt_rows() -> RowSplit | None:
    """The current forward pass's prompt rows (None: outside one, or none in it)."""
    return _prompt_rows


@contextmanager
def use(split: RowSplit | None) -> Iterator[None]:
    """Set the prompt rows for the forward pass run inside."""
    global _prompt_rows
    previous, _prompt_rows = _prompt_rows, split
    try:
        yield
    finally:
        _prompt_rows = previous
