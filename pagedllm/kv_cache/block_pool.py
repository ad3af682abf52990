"""The block pool: every physical KV block, its reference count, its prefix hash, and the free queue.

Free blocks sit in LRU order (FreeBlockQueue, a doubly linked list of block ids): allocation takes
from the head, freeing appends at the tail. A freed block keeps its hash, so a later request can still hit
it, until allocation reuses it and evicts the hash. Every full block a request computes is registered, also when
another block already holds the same content (vLLM's layout: a hash maps to all its blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pagedllm.kv_cache.hashing import BlockHash


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


# A link of a block that is not in the free queue.
NOT_FREE = -1


class FreeBlockQueue:
    """The free blocks, least recently freed first: a doubly linked list (vLLM's FreeKVCacheBlockQueue)
    between two sentinels. Taking the head, appending at the tail and taking a block out of the middle (a
    prefix-cache hit on an idle block) touch only that block's and its neighbours' links, never a table of
    every block. The links are block ids in two arrays, not references between blocks: blocks hold no
    reference to each other, so the pool forms no reference cycles and reference counting frees it whole."""

    def __init__(self, blocks: list[KVCacheBlock]):
        size = max((block.block_id for block in blocks), default=-1) + 1
        self._head, self._tail = size, size + 1  # the sentinels' ids
        self._blocks: list[KVCacheBlock | None] = [None] * size  # by id
        self._prev = [NOT_FREE] * (size + 2)
        self._next = [NOT_FREE] * (size + 2)
        for block in blocks:
            self._blocks[block.block_id] = block
        chain = [self._head, *(block.block_id for block in blocks), self._tail]
        for prev, block_id in zip(chain, chain[1:]):
            self._next[prev], self._prev[block_id] = block_id, prev
        self._len = len(blocks)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block_id = self._next[self._head]
        while block_id != self._tail:
            block = self._blocks[block_id]
            assert block is not None
            yield block
            block_id = self._next[block_id]

    def __contains__(self, block: KVCacheBlock) -> bool:
        return self._next[block.block_id] != NOT_FREE

    def popleft(self) -> KVCacheBlock:
        block_id = self._next[self._head]
        if block_id == self._tail:
            raise IndexError("no free block")
        block = self._blocks[block_id]
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        assert self._next[block_id] == NOT_FREE, f"block {block_id} is already free"
        last = self._prev[self._tail]
        self._next[last] = block_id
        self._prev[block_id] = last
        self._next[block_id] = self._tail
        self._prev[self._tail] = block_id
        self._blocks[block_id] = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        prev, next_ = self._prev[block_id], self._next[block_id]
        assert prev != NOT_FREE and next_ != NOT_FREE, f"block {block_id} is not free"
        self._next[prev] = next_
        self._prev[next_] = prev
        self._prev[block_id] = self._next[block_id] = NOT_FREE
        self._len -= 1

    def check_links(self) -> bool:
        """Whether walking the links backwards meets the blocks walked forwards, and only they are linked."""
        forward = [block.block_id for block in self]
        backward = []
        block_id = self._prev[self._tail]
        while block_id != self._head:
            backward.append(block_id)
            block_id = self._prev[block_id]
        linked = {i for i, next_ in enumerate(self._next[:self._head]) if next_ != NOT_FREE}
        return forward == backward[::-1] and linked == set(forward) and len(forward) == self._len


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, reserve_null_block: bool = False):
        assert num_blocks > (1 if reserve_null_block else 0)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # The null block (vLLM's name) stands in a block table for a block given back while the table
        # keeps its place (sliding-window layers): never allocated, never freed, never read by attention.
        self.null_block: KVCacheBlock | None = self.blocks[0] if reserve_null_block else None
        if self.null_block is not None:
            self.null_block.ref_cnt = 1  # held by the pool itself: never in the free queue
        self.free_queue = FreeBlockQueue(self.blocks[1:] if reserve_null_block else self.blocks)
        # Blocks requests can hold: all but the null block.
        self.num_usable_blocks = num_blocks - (1 if reserve_null_block else 0)
        # hash -> every block holding that content, by id (vLLM's layout). Two requests that compute the
        # same block (a prompt whose last block is always recomputed, a greedy output seen before) both
        # register it: a second holder is never refused, so no step has to offer it again later.
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self._num_hashed_blocks = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix-cache hash (a content computed twice counts twice)."""
        return self._num_hashed_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= self.num_free_blocks, "caller must check num_free_blocks first"
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # reused: its cached content is gone
                self._drop_hash(block)
                self.num_evictions += 1
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _drop_hash(self, block: KVCacheBlock) -> None:
        holders = self.cached_blocks[block.block_hash]
        del holders[block.block_id]
        if not holders:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        self._num_hashed_blocks -= 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding this content: one in use if there is one (sharing it keeps an idle copy free
        for eviction), else the idle one."""
        holders = self.cached_blocks.get(block_hash) if self.enable_caching else None
        if not holders:
            return None
        for block in holders.values():
            if block.ref_cnt > 0:
                return block
        return next(iter(holders.values()))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (out of the free queue if idle)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail of the free queue (most recent)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (beside any other block holding the same content)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, {})[block.block_id] = block
        self._num_hashed_blocks += 1

    def uncache_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self._drop_hash(block)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        self._num_hashed_blocks = 0
        return True
