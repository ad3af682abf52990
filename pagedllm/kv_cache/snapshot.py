"""A consistent picture of the KV cache, block by block, for the live /kv-cache page.

It is taken in two halves because they run on different threads. `KVCacheManager.snapshot()` runs on
the engine thread between two steps (so no step is half applied) and only copies numbers out: every
block's reference count and whether it holds a prefix hash, plus each request's block table. That
copy is a few list comprehensions over the pool. `KVCacheSnapshot.to_dict()` then builds the JSON off
the engine thread, so the engine stalls for the copy alone.

Large pools are summarised without losing anything: `blocks` is run-length encoded, one entry per run
of consecutive block ids that share state, reference count and holders (`count` says how many), so
100,000 free blocks are one entry and a request's freshly allocated blocks (taken in id order from the
free queue) are a few. Its length is bounded by the runs, not by the pool.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BLOCK_FREE = "free"      # no holder, no prefix hash: the next allocation may take it
BLOCK_CACHED = "cached"  # no holder, but still holds a prefix a later request can hit (until evicted)
BLOCK_USED = "used"      # held by ref_cnt block tables
_FREE, _CACHED, _USED = 0, 1, 2  # the same states as small ints, for numpy


@dataclass(frozen=True)
class RequestBlocks:
    """One request as the page shows it (vLLM's names)."""

    request_id: str
    status: str                  # "waiting", "running" or "preempted"
    block_table: list[int]
    num_computed_tokens: int
    num_cached_tokens: int       # prefix-cache hit at first admission (0 before it)
    num_tokens: int              # prompt + output so far
    num_prompt_tokens: int
    parent_id: str | None = None  # the parallel-sampling (n > 1) parent of this sample

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "status": self.status, "block_table": self.block_table,
                "num_computed_tokens": self.num_computed_tokens, "num_cached_tokens": self.num_cached_tokens,
                "num_tokens": self.num_tokens, "num_prompt_tokens": self.num_prompt_tokens,
                "parent_id": self.parent_id}


@dataclass
class KVCacheSnapshot:
    """Raw numbers copied from the block pool between steps; `to_dict()` makes the JSON."""

    block_size: int
    num_blocks: int
    num_free_blocks: int          # the free queue's length (cached blocks included), as the metric
    ref_cnts: list[int]           # per block id
    hashed: list[bool]            # per block id: holds a registered prefix hash
    block_tables: dict[str, list[int]]  # every block table the manager holds, by request id
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0     # of those, tokens found
    num_preemptions: int = 0
    requests: list[RequestBlocks] = field(default_factory=list)
    time: float = field(default_factory=time.time)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def block_state(self, block_id: int) -> str:
        if self.ref_cnts[block_id] > 0:
            return BLOCK_USED
        return BLOCK_CACHED if self.hashed[block_id] else BLOCK_FREE

    def holders(self) -> dict[int, list[str]]:
        """Block id -> ids of the requests whose block table holds it (a dict of every held block:
        for tests and small pools; `block_runs` avoids building it)."""
        holders: dict[int, list[str]] = {}
        for request_id, table in self.block_tables.items():
            for block_id in table:
                holders.setdefault(block_id, []).append(request_id)
        return holders

    def block_runs(self) -> list[dict[str, Any]]:
        """`blocks`, run-length encoded: {id (first of the run), count, state, ref_cnt, request_ids}.

        Everything proportional to the pool or to the block tables is numpy; Python objects are made
        only per run and per (shared block, holder) pair, so no garbage-collector pass is set off by
        a hundred thousand short-lived lists."""
        num_blocks = len(self.ref_cnts)
        if num_blocks == 0:
            return []
        ref_cnts = np.asarray(self.ref_cnts, dtype=np.int64)
        states = np.where(ref_cnts > 0, _USED, np.asarray(self.hashed, dtype=np.int8))
        request_ids = list(self.block_tables)
        lengths = [len(table) for table in self.block_tables.values()]
        held = np.fromiter(itertools.chain.from_iterable(self.block_tables.values()), dtype=np.int64,
                           count=sum(lengths))
        holder_index = np.repeat(np.arange(len(request_ids), dtype=np.int64), lengths)
        # holder group per block: 0 for none, 1 + request index for one holder, and for a shared block
        # one number per distinct set of holders (above every request index)
        groups = np.zeros(num_blocks, dtype=np.int64)
        groups[held] = holder_index + 1
        shared_holders: dict[int, list[str]] = {}
        is_shared = ref_cnts[held] > 1
        for block_id, index in zip(held[is_shared].tolist(), holder_index[is_shared].tolist()):
            shared_holders.setdefault(block_id, []).append(request_ids[index])
        group_of: dict[tuple[str, ...], int] = {}
        for block_id, holders in shared_holders.items():
            groups[block_id] = len(request_ids) + 1 + group_of.setdefault(tuple(holders), len(group_of))
        changes = (np.flatnonzero((states[1:] != states[:-1]) | (ref_cnts[1:] != ref_cnts[:-1])
                                  | (groups[1:] != groups[:-1])) + 1).tolist()
        runs = []
        for start, end in zip([0, *changes], [*changes, num_blocks]):
            group = int(groups[start])
            holders = shared_holders.get(start, []) if group > len(request_ids) else \
                [request_ids[group - 1]] if group else []
            runs.append({"id": start, "count": end - start, "state": self.block_state(start),
                         "ref_cnt": self.ref_cnts[start], "request_ids": holders})
        return runs

    def to_dict(self) -> dict[str, Any]:
        blocks = self.block_runs()
        by_state = {BLOCK_FREE: 0, BLOCK_CACHED: 0, BLOCK_USED: 0}
        num_shared = 0
        for run in blocks:
            by_state[run["state"]] += run["count"]
            num_shared += run["count"] if run["ref_cnt"] > 1 else 0
        return {
            "time": self.time,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_blocks_by_state": by_state,
            "num_shared_blocks": num_shared,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "blocks": blocks,
            "requests": [request.to_dict() for request in self.requests],
        }
