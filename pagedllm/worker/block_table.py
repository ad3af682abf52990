"""The runner's copy of every live request's block table, as rows of one array (vLLM V1's BlockTable).

The KV cache manager reports which tables it wrote since the last step (`take_table_changes`: per
request, the first index written and the ids from there on); the plan carries that, and the runner
writes just those entries here. A step's tables are then one gather of rows, not a rebuild from Python
lists whose cost grows with every request's length.

Entries past a request's current length may be stale (a trim only shortens a table); readers take the
first ceil(seq_len / block_size) entries of a row, which are always exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class BlockTables:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int):
        self.table = np.zeros((max(1, max_num_reqs), max(1, max_blocks_per_req)), dtype=np.int64)
        self.tensor = torch.from_numpy(self.table)  # the same memory, for the step-input op
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def apply(self, changes: dict[str, tuple[int, list[int]]]) -> None:
        """Write what the KV cache manager changed (see KVCacheManager.take_table_changes)."""
        for request_id, (first, block_ids) in changes.items():
            row = self.row_of.get(request_id)
            if row is None:
                row = self._new_row(request_id)
            end = first + len(block_ids)
            if end > self.table.shape[1]:
                self._grow(rows=self.table.shape[0], cols=max(end, 2 * self.table.shape[1]))
            self.table[row, first:end] = block_ids

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget requests that left the engine (their rows are reused)."""
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def rows(self, request_ids: Iterable[str]) -> list[int]:
        row_of = self.row_of
        return [row_of[request_id] for request_id in request_ids]

    def _new_row(self, request_id: str) -> int:
        if not self._free_rows:
            num_rows = self.table.shape[0]
            self._grow(rows=2 * num_rows, cols=self.table.shape[1])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self.row_of[request_id] = row
        return row

    def _grow(self, rows: int, cols: int) -> None:
        table = np.zeros((rows, cols), dtype=np.int64)
        old_rows, old_cols = self.table.shape
        table[:old_rows, :old_cols] = self.table
        self.table = table
        self.tensor = torch.from_numpy(table)
