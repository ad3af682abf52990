"""The KV cache manager: block tables per request on top of the block pool.

It answers three questions for the scheduler: which prefix of a request is already cached, can the
request's next tokens get slots (allocating blocks), and which blocks to give back. It knows nothing of
models or tensors. Requests share blocks only through the prefix cache (full blocks of final tokens,
never written again), so a block is never copied: parallel samples (n > 1) are separate requests that
share their prompt that way.

KV cache groups (vLLM's hybrid allocator): the layers of a model are split into groups of the same
number of layers, each group all full attention or all sliding over one window; a physical block holds
one block of KV for each layer of a group (the runner's layer i of every group shares one cache tensor),
so every group draws on the one block pool and each request has one block table per group. A model
whose layers are all alike has one group; Gemma 3 (five sliding layers to one full) has one full group
and five sliding ones. The manager is told only each group's window.

Sliding window: a query at position p reads keys p - sliding_window + 1 .. p, so once a request's next
query is at position n, every block wholly before n - sliding_window + 1 is dead for a sliding group.
Before each allocation those blocks go back to the pool (keeping their prefix-cache hash, so a later
request can still hit them) and the null block takes their place in the group's table, so positions and
indices stay as they were; the attention kernels never read a block before a query's window. Such a group
then holds at most ceil(sliding_window / block_size) + 1 blocks per request beyond the ones its current
step writes, while a full group keeps all of its blocks.

Prefix caching: a block's hash is keyed by its group too (the same tokens are other KV in other layers).
A hit of k blocks must be valid in every group: a full group needs all k blocks, a sliding group only
those the query at position k * block_size can see (the null block stands in for the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedllm.kv_cache.hashing import BlockHash, extend_block_hashes
from pagedllm.kv_cache.snapshot import KVCacheSnapshot

# What the runner's copy of one group's tables has not seen yet: request id -> (first index written,
# the block ids from there on). take_table_changes() gives one such dict per KV cache group.
TableChanges = dict[str, tuple[int, list[int]]]


class CacheableRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_per_request(group_windows: Sequence[int | None], num_tokens: int, block_size: int,
                       first_chunk_tokens: int = 0) -> int:
    """The fewest blocks over all KV cache groups in which a request of num_tokens can run alone: a full
    group holds all its tokens, a sliding group at most ceil(window / block_size) + 1 blocks while
    decoding, but every group holds the whole first prefill chunk (first_chunk_tokens) while it runs."""
    full = cdiv(num_tokens, block_size)
    decoding = sum(full if window is None else min(full, cdiv(window, block_size) + 1) for window in group_windows)
    return max(decoding, len(group_windows) * cdiv(first_chunk_tokens, block_size))


@dataclass(eq=False)
class KVCacheGroupTables:
    """One KV cache group's block tables (vLLM's SingleTypeKVCacheManager state)."""

    sliding_window: int | None  # None: full attention
    req_to_blocks: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    # The same tables as block ids, kept in step with req_to_blocks: the scheduler hands every running
    # request's table to the runner each step, and rebuilding it from the blocks cost more than
    # everything else the scheduler does for a decoding request.
    req_to_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request, how many leading table entries are the null block (freed out of the window).
    num_skipped_blocks: dict[str, int] = field(default_factory=dict)
    # Per request, how many leading blocks were already offered to the prefix cache (vLLM's
    # num_cached_block): each step registers only the blocks that became full since.
    num_cached_blocks: dict[str, int] = field(default_factory=dict)
    # Request id -> the first index of its table written since the last take_table_changes(). Tables
    # change only here, so the runner updates a few rows a step instead of rebuilding every table.
    table_changes: dict[str, int] = field(default_factory=dict)


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of group `group` (group 0 keeps the plain hash)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int | None = None,
                 kv_cache_groups: Sequence[int | None] | None = None, key_prompt_end: bool = False):
        """kv_cache_groups: each group's sliding window (None: full attention); default one group sliding
        over `sliding_window` (None: full). key_prompt_end: the model computes prompt tokens by another
        arithmetic than generated ones, so blocks past a prompt's end are keyed by it (extend_block_hashes)."""
        self.key_prompt_end = key_prompt_end
        if kv_cache_groups is None:
            kv_cache_groups = [sliding_window]
        assert len(kv_cache_groups) >= 1 and (sliding_window is None or len(kv_cache_groups) == 1)
        assert all(window is None or window > 0 for window in kv_cache_groups)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = [KVCacheGroupTables(window) for window in kv_cache_groups]
        self.num_groups = len(self.groups)
        # One full-attention group (most models): a step that fits the blocks a request holds is answered
        # at once (allocate_slots).
        self._single_full_group = self.groups[0] if self.num_groups == 1 and self.groups[0].sliding_window is None \
            else None
        # The window when there is one group and it slides (the case every earlier caller knew).
        self.sliding_window = kv_cache_groups[0] if self.num_groups == 1 else None
        self.pool = BlockPool(num_blocks, enable_caching,
                              reserve_null_block=any(window is not None for window in kv_cache_groups))
        self.null_block = self.pool.null_block
        # Group 0's tables under their old names (the only group of most models).
        group0 = self.groups[0]
        self.req_to_blocks = group0.req_to_blocks
        self.req_to_block_ids = group0.req_to_block_ids
        self.num_skipped_blocks = group0.num_skipped_blocks
        self.num_cached_blocks = group0.num_cached_blocks
        self.table_changes = group0.table_changes
        self.num_window_freed_blocks = 0  # blocks given back by windows, over the engine's life
        # Prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in `group` as ids. The manager's own list, valid until the request's
        next allocation, trim or free: read it (or copy it), never change it."""
        return self.groups[group].req_to_block_ids.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_hashes(self, request: CacheableRequest) -> None:
        if self.enable_caching:
            # A block computed under a LoRA adapter holds that adapter's KV: its id keys the hash, so it is
            # never a hit for another adapter or the base model
            lora = getattr(request, "lora_request", None)
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                ("lora", lora.lora_int_id) if lora is not None else (),
                                request.num_prompt_tokens if self.key_prompt_end else None)

    # ---- prefix hits ----
    def get_computed_blocks(self, request: CacheableRequest, max_cached_tokens: int
                            ) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request that every group can use,
        capped so that at least one token is left to compute (there must be logits to sample from).
        With several groups the blocks come group after group, the same number each (allocate_slots
        splits them again)."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = max(0, max_cached_tokens) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        if self.num_groups == 1 and self.sliding_window is None:
            blocks = self._cached_run(hashes, 0)
            return blocks, len(blocks) * self.block_size
        found: list[list[KVCacheBlock | None]] = []
        best = len(hashes)
        valid_in_all = [True] * (len(hashes) + 1)  # index k: a hit of k blocks
        for index, group in enumerate(self.groups):
            if group.sliding_window is None:
                run = self._cached_run(hashes[:best], index)
                best = len(run)
                found.append(list(run))
            else:
                blocks = [self.pool.get_cached_block(group_block_hash(h, index)) for h in hashes]
                for k, ok in enumerate(self._window_hits(blocks, group.sliding_window)):
                    valid_in_all[k] = valid_in_all[k] and ok
                found.append(blocks)
        best = max(k for k in range(best + 1) if valid_in_all[k])
        hit: list[KVCacheBlock] = []
        for group, blocks in zip(self.groups, found):
            if group.sliding_window is None:
                hit.extend(blocks[:best])  # type: ignore[misc]
            else:
                first = self._first_visible_block(best * self.block_size, group.sliding_window)
                assert self.null_block is not None and all(b is not None for b in blocks[first:best])
                hit.extend([self.null_block] * first + blocks[first:best])  # type: ignore[list-item]
        return hit, best * self.block_size

    def _cached_run(self, hashes: list[BlockHash], group: int) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(group_block_hash(block_hash, group))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _first_visible_block(self, position: int, sliding_window: int) -> int:
        """The first block a query at `position` can see through the window."""
        return max(0, position - sliding_window + 1) // self.block_size

    def _window_hits(self, found: list[KVCacheBlock | None], sliding_window: int) -> list[bool]:
        """Per k = 0 .. len(found): whether a hit of k blocks has every block the query at k * block_size
        can see; the blocks before them need not be cached (they would be given back at once). So a long
        shared prompt still hits after its early blocks were evicted."""
        valid = [True]
        run = 0  # cached blocks in a row ending at block k - 1
        for k, block in enumerate(found, start=1):
            run = run + 1 if block is not None else 0
            valid.append(run >= k - self._first_visible_block(k * self.block_size, sliding_window))
        return valid

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def peek_cached_tokens(self, request: CacheableRequest) -> int:
        """How many leading tokens of the request are cached now (no references taken)."""
        _, num_cached = self.get_computed_blocks(request, request.num_tokens - 1)
        return num_cached

    # ---- allocation ----
    def allocate_slots(self, request: CacheableRequest, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_cacheable_tokens: int | None = None, num_lookahead_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones, in every group. Returns
        False (and changes nothing) when the pool cannot provide the blocks; the scheduler then preempts
        or waits.

        `num_cacheable_tokens`: how many of the request's tokens are final after this step (speculative
        tokens are not), so only blocks full of final tokens enter the prefix cache.
        `num_lookahead_tokens`: slots past the new tokens for a draft model's KV (vLLM's name): it writes
        the positions of the tokens this step samples and of its drafts, in the same blocks."""
        bs = self.block_size
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        group = self._single_full_group
        if group is not None and not new_computed_blocks:
            # One full-attention group and no prefix hit (every decode step of most models): the blocks the
            # slots need past those the request holds, then at most the blocks that filled to offer the
            # prefix cache. The same as the general path below, without its hits and per-group plans.
            blocks = group.req_to_blocks.get(request_id)
            end = num_computed + num_new_tokens
            num_new_blocks = cdiv(end + num_lookahead_tokens, bs) - (len(blocks) if blocks is not None else 0)
            if num_new_blocks > 0:
                if num_new_blocks > self.pool.num_free_blocks:
                    return False
                self._allocate(group, request_id, num_new_blocks)
            elif blocks is None:
                self._allocate(group, request_id, 0)
            if self.enable_caching and end // bs > group.num_cached_blocks.get(request_id, 0):
                self._cache_full_blocks(0, group, request, end, num_cacheable_tokens)
            return True
        if new_computed_blocks and self.num_groups > 1:
            k = len(new_computed_blocks) // self.num_groups
            hits = [new_computed_blocks[i * k:(i + 1) * k] for i in range(self.num_groups)]
        else:
            k = len(new_computed_blocks or ())
            hits = [new_computed_blocks] if new_computed_blocks else [[]] * self.num_groups
        if not new_computed_blocks and self.null_block is not None:
            for group in self.groups:
                if group.sliding_window is not None:
                    self._remove_skipped_blocks(group, request_id, num_computed)
        total_tokens = num_computed + k * bs + num_new_tokens
        num_slots = total_tokens + num_lookahead_tokens
        # Blocks are shared only through the prefix cache, and only full ones, which no request writes
        # into again: a request's writes always land in blocks it alone holds, so nothing is ever copied.
        plans: list[int] = []
        num_needed = num_evictable_touched = 0
        for group, hit in zip(self.groups, hits):
            blocks = group.req_to_blocks.get(request_id)
            num_new_blocks = max(0, cdiv(num_slots, bs) - len(blocks or ()) - len(hit))
            num_needed += num_new_blocks
            # (the null block's ref count is never 0)
            num_evictable_touched += sum(1 for block in hit if block.ref_cnt == 0) if hit else 0
            plans.append(num_new_blocks)
        if num_needed > self.pool.num_free_blocks - num_evictable_touched:
            return False
        if new_computed_blocks:
            # Every group's hit first: a block one group hits may sit idle in the free queue, where another
            # group's new blocks would otherwise be taken from.
            for group, hit in zip(self.groups, hits):
                self._take_hit(group, request_id, hit)
        for group, num_new_blocks in zip(self.groups, plans):
            if num_new_blocks or request_id not in group.req_to_blocks:
                self._allocate(group, request_id, num_new_blocks)
        if self.enable_caching:
            for index, group in enumerate(self.groups):
                if total_tokens // bs > group.num_cached_blocks.get(request_id, 0):
                    self._cache_full_blocks(index, group, request, total_tokens, num_cacheable_tokens)
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the request's blocks that no query from position num_computed_tokens on can see, in
        every sliding group (see the module's note on the sliding window)."""
        assert self.null_block is not None
        for group in self.groups:
            if group.sliding_window is not None:
                self._remove_skipped_blocks(group, request_id, num_computed_tokens)

    def _remove_skipped_blocks(self, group: KVCacheGroupTables, request_id: str, num_computed_tokens: int) -> None:
        assert group.sliding_window is not None and self.null_block is not None
        num_dead = self._first_visible_block(num_computed_tokens, group.sliding_window)
        done = group.num_skipped_blocks.get(request_id, 0)
        if num_dead <= done:
            return
        blocks = group.req_to_blocks.get(request_id)
        if blocks is None:
            return
        block_ids = group.req_to_block_ids[request_id]
        num_dead = min(num_dead, len(blocks))
        freed = blocks[done:num_dead]
        for i in range(done, num_dead):
            blocks[i] = self.null_block
            block_ids[i] = self.null_block.block_id
        group.num_skipped_blocks[request_id] = num_dead
        group.table_changes[request_id] = min(done, group.table_changes.get(request_id, done))
        self.num_window_freed_blocks += len(freed)
        self.pool.free_blocks(reversed(freed))

    def num_live_blocks(self, request_id: str, group: int | None = None) -> int:
        """Blocks the request holds (its tables less the null entries), in `group` or in all groups."""
        groups = self.groups if group is None else [self.groups[group]]
        return sum(len(g.req_to_blocks.get(request_id, ())) - g.num_skipped_blocks.get(request_id, 0)
                   for g in groups)

    def _take_hit(self, group: KVCacheGroupTables, request_id: str, hit: list[KVCacheBlock]) -> None:
        """A new request's table in one group starts with its prefix-cache hit."""
        assert request_id not in group.req_to_blocks
        # (a sliding-window hit starts with null blocks: positions no query will read again)
        num_null = sum(1 for block in hit if block is self.null_block)
        if num_null:
            assert all(block is self.null_block for block in hit[:num_null])
            group.num_skipped_blocks[request_id] = num_null
        self.pool.touch(hit[num_null:])
        group.req_to_blocks[request_id] = list(hit)
        group.req_to_block_ids[request_id] = [block.block_id for block in hit]
        group.table_changes[request_id] = 0

    def _allocate(self, group: KVCacheGroupTables, request_id: str, num_new_blocks: int) -> None:
        """allocate_slots' new blocks in one group, at the end of the request's table (the pool's room
        already checked)."""
        blocks = group.req_to_blocks.setdefault(request_id, [])
        block_ids = group.req_to_block_ids.setdefault(request_id, [])
        if num_new_blocks:
            first_changed = len(block_ids)
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            block_ids.extend(block.block_id for block in new_blocks)
            group.table_changes[request_id] = min(first_changed, group.table_changes.get(request_id, first_changed))

    def _cache_full_blocks(self, index: int, group: KVCacheGroupTables, request: CacheableRequest,
                           total_tokens: int, num_cacheable_tokens: int | None) -> None:
        """Offer the prefix cache the request's blocks that are full of final tokens and not offered yet."""
        cacheable = min(total_tokens, request.num_tokens if num_cacheable_tokens is None else num_cacheable_tokens)
        num_full = cacheable // self.block_size
        num_done = group.num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_done:
            return
        self._update_hashes(request)
        blocks = group.req_to_blocks[request.request_id]
        for i in range(num_done, num_full):
            if blocks[i] is not self.null_block:  # (a block the window gave back before it was final)
                self.pool.cache_block(blocks[i], group_block_hash(request.block_hashes[i], index))
        group.num_cached_blocks[request.request_id] = num_full

    # ---- giving back ----
    def free(self, request_id: str) -> None:
        """Give back the request's blocks in every group (it finished, was aborted or preempted)."""
        for group in self.groups:
            blocks = group.req_to_blocks.pop(request_id, [])
            group.req_to_block_ids.pop(request_id, None)
            group.table_changes.pop(request_id, None)
            group.num_cached_blocks.pop(request_id, None)
            blocks = blocks[group.num_skipped_blocks.pop(request_id, 0):]
            # Tail blocks first, so they are evicted before the prefix that others are likelier to share.
            self.pool.free_blocks(reversed(blocks))

    def forget_uncomputed(self, request: CacheableRequest) -> None:
        """Take the prefix-cache hashes off the request's blocks past its computed tokens: a step that
        failed registered them at allocation, but may never have written their KV."""
        num_kept = request.num_computed_tokens // self.block_size
        for group in self.groups:
            for block in group.req_to_blocks.get(request.request_id, [])[num_kept:]:
                self.pool.uncache_block(block)
            if request.request_id in group.num_cached_blocks:
                group.num_cached_blocks[request.request_id] = min(group.num_cached_blocks[request.request_id],
                                                                  num_kept)

    def trim(self, request: CacheableRequest) -> None:
        """Give back blocks past the request's computed tokens (rejected speculative tokens)."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        for group in self.groups:
            blocks = group.req_to_blocks.get(request.request_id)
            if not blocks or len(blocks) <= keep:
                continue
            extra = blocks[keep:]
            del blocks[keep:]
            del group.req_to_block_ids[request.request_id][keep:]
            if group.num_cached_blocks.get(request.request_id, 0) > keep:
                group.num_cached_blocks[request.request_id] = keep
            self.pool.free_blocks(reversed(extra))

    def take_table_changes(self) -> list[TableChanges]:
        """Per group, request id -> (first index, the block ids from there on) for every table written
        since the last call; applied in order, they keep a copy of every live table exact. A trim only
        shortens a table: whatever is written past its new end later is reported then. An empty list
        when no table changed (most decode steps), so a plan can say "nothing" by its falsity."""
        if not any(group.table_changes for group in self.groups):
            return []
        changes = []
        for group in self.groups:
            ids = group.req_to_block_ids
            changes.append({request_id: (first, ids[request_id][first:])
                            for request_id, first in group.table_changes.items()})
            group.table_changes.clear()
        return changes

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def snapshot(self) -> KVCacheSnapshot:
        """Copy every block's reference count and hash flag and every block table, for the /kv-cache
        page. Only copies (O(num_blocks) attribute reads), so it is cheap to run between two steps;
        `KVCacheSnapshot.to_dict()` does the rest elsewhere."""
        blocks = self.pool.blocks
        return KVCacheSnapshot(
            block_size=self.block_size, num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            ref_cnts=[block.ref_cnt for block in blocks],
            hashed=[block.block_hash is not None for block in blocks],
            # (with several groups a request's tables one after another: a block is held by one group)
            block_tables={request_id: [block.block_id for group in self.groups
                                       for block in group.req_to_blocks.get(request_id, ())]
                          for request_id in self.req_to_blocks},
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits)
