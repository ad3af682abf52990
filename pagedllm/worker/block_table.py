"""The runner's copy of every live request's block table, as rows of one array (vLLM V1's BlockTable).

The KV cache manager reports which tables it wrote since the last step (`take_table_changes`: per KV
cache group and request, the first index written and the ids from there on); the plan carries that, and
the runner writes just those entries here. A step's tables are then one gather of rows, not a rebuild from
Python lists whose cost grows with every request's length.

Entries past a request's current length may be stale (a trim only shortens a table); readers take the
first ceil(seq_len / block_size) entries of a row, which are always exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class BlockTables:
    """One array per KV cache group (kv_cache/manager.py), a request's row the same in each."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, num_groups: int = 1):
        shape = (max(1, max_num_reqs), max(1, max_blocks_per_req))
        self.tables = [np.zeros(shape, dtype=np.int64) for _ in range(num_groups)]
        self.tensors = [torch.from_numpy(table) for table in self.tables]  # the same memory, for the step-input op
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(shape[0] - 1, -1, -1))

    @property
    def table(self) -> np.ndarray:
        """Group 0's tables (the only group of most models)."""
        return self.tables[0]

    @property
    def tensor(self) -> torch.Tensor:
        return self.tensors[0]

    def apply(self, changes: list[dict[str, tuple[int, list[int]]]]) -> None:
        """Write what the KV cache manager changed, group by group (see KVCacheManager.take_table_changes)."""
        for group, group_changes in enumerate(changes):
            # one numpy write for the group (a step that opens a block in each of 64 requests changes 64
            # tables by one entry, and a slice assignment per table cost more than the entries)
            rows: list[int] = []
            cols: list[int] = []
            ids: list[int] = []
            end = 0
            for request_id, (first, block_ids) in group_changes.items():
                num = len(block_ids)
                rows += [self.row(request_id)] * num
                cols += range(first, first + num)
                ids += block_ids
                end = max(end, first + num)
            if end > self.table.shape[1]:
                self._grow(rows=self.table.shape[0], cols=max(end, 2 * self.table.shape[1]))
            if ids:
                self.tables[group][rows, cols] = ids

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget requests that left the engine (their rows are reused)."""
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def row(self, request_id: str) -> int:
        """The request's row, given it here if it has none."""
        row = self.row_of.get(request_id)
        return row if row is not None else self._new_row(request_id)

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
        old_rows, old_cols = self.table.shape
        for group, old in enumerate(self.tables):
            table = np.zeros((rows, cols), dtype=np.int64)
            table[:old_rows, :old_cols] = old
            self.tables[group] = table
            self.tensors[group] = torch.from_numpy(table)
