"""The KV cache manager: block tables per request on top of the block pool.

It answers three questions for the scheduler: which prefix of a request is already cached, can the
request's next tokens get slots (allocating blocks, copying a shared partial block before a write),
and which blocks to give back. It knows nothing of models or tensors: block copies it decides on are
handed to the model runner as (src, dst) pairs.

Sliding window (`sliding_window`, given only when every attention layer of the model slides over that
many tokens): a query at position p reads keys p - sliding_window + 1 .. p, so once a request's next
query is at position n, every block wholly before n - sliding_window + 1 is dead for it. Before each
allocation those blocks go back to the pool (keeping their prefix-cache hash, so a later request can
still hit them) and the null block takes their place in the table, so positions and indices stay as
they were; the attention kernels never read a block before a query's window. A request then holds at
most ceil(sliding_window / block_size) + 1 blocks beyond the ones its current step writes. Models that
mix full and sliding layers keep every block (the full layers read them all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedllm.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedllm.kv_cache.hashing import BlockHash, extend_block_hashes
from pagedllm.kv_cache.snapshot import KVCacheSnapshot


class CacheableRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int | None = None):
        assert sliding_window is None or sliding_window > 0
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null_block=sliding_window is not None)
        self.null_block = self.pool.null_block
        # Per request, how many leading table entries are the null block (freed out of the window).
        self.num_skipped_blocks: dict[str, int] = {}
        self.num_window_freed_blocks = 0  # blocks given back by the window, over the engine's life
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept in step with req_to_blocks: the scheduler hands every
        # running request's table to the runner each step, and rebuilding it from the blocks cost more
        # than everything else the scheduler does for a decoding request.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # What the runner's copy of the tables (worker/block_table.py) has not seen yet: request id -> the
        # first index of its table written since the last take_table_changes(). Tables change only here,
        # so the runner updates a few rows a step instead of rebuilding every table from lists.
        self.table_changes: dict[str, int] = {}
        # Per request, how many leading blocks were already offered to the prefix cache (vLLM's
        # num_cached_block): each step registers only the blocks that became full since, instead of
        # walking every full block of every running request again.
        self.num_cached_blocks: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        # Prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids. The manager's own list, valid until the request's next
        allocation, trim or free: read it (or copy it), never change it."""
        return self.req_to_block_ids.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_hashes(self, request: CacheableRequest) -> None:
        if self.enable_caching:
            # A block computed under a LoRA adapter holds that adapter's KV: its id keys the hash, so it is
            # never a hit for another adapter or the base model
            lora = getattr(request, "lora_request", None)
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                ("lora", lora.lora_int_id) if lora is not None else ())

    def get_computed_blocks(self, request: CacheableRequest, max_cached_tokens: int
                            ) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request, capped so that at least
        one token is left to compute (there must be logits to sample from)."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = max(0, max_cached_tokens) // self.block_size
        if self.sliding_window is not None:
            return self._sliding_window_hit(request.block_hashes[:max_blocks])
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _sliding_window_hit(self, block_hashes: list[BlockHash]) -> tuple[list[KVCacheBlock], int]:
        """The longest hit of k blocks whose last ones, those the query at k * block_size can see, are all
        cached; the blocks before them need not be (they would be given back at once): the null block
        stands in for them. So a long shared prompt still hits after its early blocks were evicted."""
        assert self.sliding_window is not None and self.null_block is not None
        bs = self.block_size
        found = [self.pool.get_cached_block(block_hash) for block_hash in block_hashes]
        run = 0  # cached blocks in a row ending at block k - 1
        best = 0
        for k, block in enumerate(found, start=1):
            run = run + 1 if block is not None else 0
            if run >= k - max(0, k * bs - self.sliding_window + 1) // bs:
                best = k
        first = max(0, best * bs - self.sliding_window + 1) // bs
        hit = [self.null_block] * first + [block for block in found[first:best] if block is not None]
        assert len(hit) == best
        return hit, best * bs

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def peek_cached_tokens(self, request: CacheableRequest) -> int:
        """How many leading tokens of the request are cached now (no references taken)."""
        _, num_cached = self.get_computed_blocks(request, request.num_tokens - 1)
        return num_cached

    def allocate_slots(self, request: CacheableRequest, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_cacheable_tokens: int | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones. Returns False (and changes
        nothing) when the pool cannot provide the blocks; the scheduler then preempts or waits.

        `num_cacheable_tokens`: how many of the request's tokens are final after this step (speculative
        tokens are not), so only blocks full of final tokens enter the prefix cache."""
        bs = self.block_size
        if self.sliding_window is not None and not new_computed_blocks:
            self.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        blocks = self.req_to_blocks.get(request.request_id)
        num_computed = request.num_computed_tokens
        # A running request's step (a decode, mostly) whose tokens fit in its blocks, writing into a block
        # it alone holds, allocates and copies nothing.
        fits = (blocks and not new_computed_blocks and num_computed + num_new_tokens <= len(blocks) * bs
                and (not num_computed % bs or num_new_tokens <= 0 or blocks[num_computed // bs].ref_cnt == 1))
        if not fits:
            blocks = self._allocate(request, num_new_tokens, new_computed_blocks or [])
            if blocks is None:
                return False
        total_tokens = num_computed + len(new_computed_blocks or ()) * bs + num_new_tokens
        if self.enable_caching and total_tokens // bs > self.num_cached_blocks.get(request.request_id, 0):
            self._cache_full_blocks(request, blocks, total_tokens, num_cacheable_tokens)
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the request's blocks that no query from position num_computed_tokens on can see
        (see the module's note on the sliding window)."""
        assert self.sliding_window is not None and self.null_block is not None
        first_visible = num_computed_tokens - self.sliding_window + 1
        num_dead = max(0, first_visible) // self.block_size
        done = self.num_skipped_blocks.get(request_id, 0)
        if num_dead <= done:
            return
        blocks = self.req_to_blocks[request_id]
        block_ids = self.req_to_block_ids[request_id]
        num_dead = min(num_dead, len(blocks))
        freed = blocks[done:num_dead]
        for i in range(done, num_dead):
            blocks[i] = self.null_block
            block_ids[i] = self.null_block.block_id
        self.num_skipped_blocks[request_id] = num_dead
        self.table_changes[request_id] = min(done, self.table_changes.get(request_id, done))
        self.num_window_freed_blocks += len(freed)
        self.pool.free_blocks(reversed(freed))

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds (its table less the null entries)."""
        return len(self.req_to_blocks.get(request_id, ())) - self.num_skipped_blocks.get(request_id, 0)

    def _allocate(self, request: CacheableRequest, num_new_tokens: int,
                  new_computed_blocks: list[KVCacheBlock]) -> list[KVCacheBlock] | None:
        """allocate_slots' blocks: the cached prefix taken, a shared partial block copied, new blocks at
        the end. Returns the request's table, or None (and changes nothing) when the pool is short."""
        bs = self.block_size
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = max(0, cdiv(total_tokens, bs) - len(blocks) - len(new_computed_blocks))
        # A partial last block shared with a forked sibling must be copied before we write into it.
        cow_block = None
        if num_new_tokens > 0 and blocks and num_computed % bs and num_computed < len(blocks) * bs:
            candidate = blocks[num_computed // bs]
            if candidate.ref_cnt > 1:
                cow_block = candidate
        num_evictable_touched = sum(1 for block in new_computed_blocks if block.ref_cnt == 0) \
            if new_computed_blocks else 0  # (the null block's ref count is never 0)
        if num_new_blocks + (cow_block is not None) > self.pool.num_free_blocks - num_evictable_touched:
            return None

        blocks = self.req_to_blocks.setdefault(request_id, [])
        block_ids = self.req_to_block_ids.setdefault(request_id, [])
        first_changed = len(block_ids)
        if new_computed_blocks:
            # (a sliding-window hit starts with null blocks: positions no query will read again)
            num_null = sum(1 for block in new_computed_blocks if block is self.null_block)
            if num_null:
                assert not blocks and all(block is self.null_block for block in new_computed_blocks[:num_null])
                self.num_skipped_blocks[request_id] = num_null
            self.pool.touch(new_computed_blocks[num_null:])
            blocks.extend(new_computed_blocks)
            block_ids.extend(block.block_id for block in new_computed_blocks)
        if cow_block is not None:
            (copy,) = self.pool.get_new_blocks(1)
            index = num_computed // bs
            blocks[index] = copy
            block_ids[index] = copy.block_id
            first_changed = min(first_changed, index)
            self.pending_copies.append((cow_block.block_id, copy.block_id))
            self.pool.free_blocks([cow_block])
        if num_new_blocks:
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            block_ids.extend(block.block_id for block in new_blocks)
        if first_changed < len(block_ids):
            self.table_changes[request_id] = min(first_changed, self.table_changes.get(request_id, first_changed))
        return blocks

    def _cache_full_blocks(self, request: CacheableRequest, blocks: list[KVCacheBlock], total_tokens: int,
                           num_cacheable_tokens: int | None) -> None:
        """Offer the prefix cache the request's blocks that are full of final tokens and not offered yet."""
        cacheable = min(total_tokens, request.num_tokens if num_cacheable_tokens is None else num_cacheable_tokens)
        num_full = cacheable // self.block_size
        num_done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_done:
            return
        self._update_hashes(request)
        for i in range(num_done, num_full):
            if blocks[i] is not self.null_block:  # (a block the window gave back before it was final)
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (parallel sampling); writes copy on demand."""
        blocks = self.req_to_blocks.get(parent_id, [])
        self.pool.touch(block for block in blocks if block is not self.null_block)
        self.req_to_blocks[child_id] = list(blocks)
        if parent_id in self.num_skipped_blocks:
            self.num_skipped_blocks[child_id] = self.num_skipped_blocks[parent_id]
        self.req_to_block_ids[child_id] = [block.block_id for block in blocks]
        self.table_changes[child_id] = 0
        self.num_cached_blocks[child_id] = self.num_cached_blocks.get(parent_id, 0)

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.req_to_block_ids.pop(request_id, None)
        self.table_changes.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        blocks = blocks[self.num_skipped_blocks.pop(request_id, 0):]
        # Tail blocks first, so they are evicted before the prefix that others are likelier to share.
        self.pool.free_blocks(reversed(blocks))

    def forget_uncomputed(self, request: CacheableRequest) -> None:
        """Take the prefix-cache hashes off the request's blocks past its computed tokens: a step that
        failed registered them at allocation, but may never have written their KV."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_kept = request.num_computed_tokens // self.block_size
        for block in blocks[num_kept:]:
            self.pool.uncache_block(block)
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], num_kept)

    def trim(self, request: CacheableRequest) -> None:
        """Give back blocks past the request's computed tokens (rejected speculative tokens)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            del self.req_to_block_ids[request.request_id][keep:]
            if self.num_cached_blocks.get(request.request_id, 0) > keep:
                self.num_cached_blocks[request.request_id] = keep
            self.pool.free_blocks(reversed(extra))

    def take_table_changes(self) -> dict[str, tuple[int, list[int]]]:
        """Request id -> (first index, the block ids from there on) for every table written since the last
        call; applied in order, they keep a copy of every live table exact. A trim only shortens a
        table: whatever is written past its new end later is reported then."""
        changes = {request_id: (first, self.req_to_block_ids[request_id][first:])
                   for request_id, first in self.table_changes.items()}
        self.table_changes.clear()
        return changes

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

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
            block_tables={request_id: [block.block_id for block in table]
                          for request_id, table in self.req_to_blocks.items()},
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits)
