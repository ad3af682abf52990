"""Property test of the block pool and KV cache manager (issue 4, "Prefix caching and copy-on-write").

A hypothesis state machine drives one KVCacheManager the way the scheduler does: admit a request
(taking its cached prefix), compute prompt chunks, append decode tokens, speculate and roll back, free,
reset the cache. Tokens come from a tiny alphabet over a few shared stems, so prefix hits (parallel
samples share their prompt this way) and evictions from a small pool are frequent.

Next to the manager the test keeps its own picture of the physical KV: each slot holds the whole token
prefix its position was computed from. It writes each step's tokens, so a wrong cache hit or a write
into a shared block shows up as a request whose blocks no longer hold its own prefix.

Checked after every operation:
- each block's ref count equals the number of block tables holding it;
- the free queue holds exactly the blocks with ref count 0 (and no block twice);
- a hash maps to at most one block, and a block with a hash is the one its hash maps to;
- the number of blocks never changes, nor their ids;
- every request's blocks hold its own computed tokens, and every cached block holds its hash's tokens;
- allocation takes free blocks least-recently-freed first; a refused allocation changes nothing.

HybridKVCacheMachine runs them with two KV cache groups in one pool, one full and one sliding (a model
mixing full and sliding layers): every check below holds per group, and a hit is valid in both.

SlidingKVCacheMachine runs the same operations (less speculation, which keeps every block) with a
sliding window: blocks wholly before a request's window go back to the pool and the null block takes
their place. There, too: a request holds at most ceil(window / block_size) + 1 blocks after a decode
step; every position its next query can see is still in a block of its own holding its prefix (no
block is freed while a position can still see it); the null block is never written, cached or freed.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedllm.kv_cache.hashing import NONE_HASH, BlockHash
from pagedllm.kv_cache.manager import KVCacheManager, cdiv, group_block_hash

# A few stems so that prompts share prefixes at every alignment; tokens from {0, 1, 2}.
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 1, 2, 2, 2), (1, 1, 1, 1, 1, 1, 1, 1, 1))
TOKEN = st.integers(0, 2)

# What one physical slot holds: the token prefix its key/value was computed from (None: never written).
Slot = tuple[int, ...] | None


@dataclass(eq=False)
class FakeRequest:
    """What the manager sees of a request (its CacheableRequest protocol)."""

    request_id: str
    tokens: list[int]  # final tokens: prompt and accepted outputs
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens being verified: not final

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def free_ids(pool: BlockPool) -> list[int]:
    """The free queue's block ids, least recently freed first."""
    return [block.block_id for block in pool.free_queue]


class KVCacheMachine(RuleBasedStateMachine):
    SLIDING = False  # SlidingKVCacheMachine: the manager gets the drawn sliding window
    HYBRID = False  # HybridKVCacheMachine: a full and a sliding KV cache group (in drawn order) in one pool

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, FakeRequest] = {}
        self.next_id = 0
        # hash -> the token prefix (through the end of its block) any block cached under it must hold
        self.hash_prefix: dict[BlockHash, tuple[int, ...]] = {}
        # the runner's copy of the block tables, kept from take_table_changes() alone (rows are never
        # dropped here: a preempted request keeps its row in the runner)
        self.runner_tables: dict[str, list[int]] = {}

    @initialize(num_blocks=st.integers(2, 16), block_size=st.sampled_from([1, 2, 3, 4]),
                enable_caching=st.booleans(), window=st.integers(1, 9), full_first=st.booleans())
    def setup(self, num_blocks: int, block_size: int, enable_caching: bool, window: int, full_first: bool) -> None:
        if self.HYBRID:
            self.window = None
            self.windows: list[int | None] = [None, window] if full_first else [window, None]
            self.kv = KVCacheManager(num_blocks, block_size, enable_caching, kv_cache_groups=self.windows)
        else:
            self.window = window if self.SLIDING else None
            self.windows = [self.window]
            self.kv = KVCacheManager(num_blocks, block_size, enable_caching, sliding_window=self.window)
        self.null_id = self.kv.null_block.block_id if self.kv.null_block is not None else None
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slots: list[list[Slot]] = [[None] * block_size for _ in range(num_blocks)]

    # ---- helpers ----
    def _snapshot(self) -> tuple:
        pool = self.kv.pool
        return ([(b.ref_cnt, b.block_hash) for b in pool.blocks], free_ids(pool),
                {h: dict(holders) for h, holders in pool.cached_blocks.items()},
                [{r: [b.block_id for b in bs] for r, bs in g.req_to_blocks.items()} for g in self.kv.groups])

    def _pick(self, index: int) -> FakeRequest:
        ids = sorted(self.requests)
        return self.requests[ids[index % len(ids)]]

    def _schedule(self, request: FakeRequest, num_new: int, cached_blocks: list | None = None,
                  num_cacheable: int | None = None) -> bool:
        """allocate_slots, then (on success) do what the model runner does: write KV."""
        if self.null_id is not None and request.request_id in self.kv.req_to_blocks:
            # allocate_slots begins with this (giving back blocks out of the window), refused or not
            self.kv.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        before = self._snapshot()
        free_order = free_ids(self.kv.pool)
        touched = {b.block_id for b in cached_blocks or ()}
        old_table = {b.block_id for g in self.kv.groups for b in g.req_to_blocks.get(request.request_id, ())}
        old_table.add(self.null_id)
        ok = self.kv.allocate_slots(request, num_new, cached_blocks, num_cacheable_tokens=num_cacheable)
        if not ok:
            assert self._snapshot() == before, "a refused allocation must change nothing"
            return False
        tables = [g.req_to_blocks[request.request_id] for g in self.kv.groups]
        # New blocks come from the head of the free queue (least recently freed first), in every group.
        taken = [b.block_id for table in tables for b in table
                 if b.block_id not in old_table and b.block_id not in touched]
        expected_order = [i for i in free_order if i not in touched]
        assert sorted(taken) == sorted(expected_order[:len(taken)]), "allocation must evict LRU first"
        for block_id in taken:  # a reused block lost its old hash
            block = self.kv.pool.blocks[block_id]
            assert block.block_hash is None or self.kv.pool.cached_blocks[block.block_hash].get(block_id) is block
        start = request.num_computed_tokens + len(cached_blocks or ()) // len(self.windows) * self.block_size
        written = request.tokens + request.spec_token_ids
        for table in tables:  # each group's layers write their own KV of the same positions
            for pos in range(start, start + num_new):
                block = table[pos // self.block_size]
                assert block.block_id != self.null_id, f"writing position {pos} into the null block"
                assert block.ref_cnt == 1, f"writing position {pos} into shared block {block.block_id}"
                self.slots[block.block_id][pos % self.block_size] = tuple(written[:pos + 1])
        request.num_computed_tokens = start + num_new
        self._record_hashes(request)
        if num_new == 1 and not cached_blocks:
            # A decode step: what the window lets a request hold in a sliding group, whatever its length.
            for group, window in enumerate(self.windows):
                if window is not None:
                    live = self.kv.num_live_blocks(request.request_id, group)
                    assert live <= cdiv(window, self.block_size) + 1, f"{live} blocks for window {window}"
        return True

    def _record_hashes(self, request: FakeRequest) -> None:
        for i, block_hash in enumerate(request.block_hashes):
            prefix = tuple(request.tokens[:(i + 1) * self.block_size])
            assert self.hash_prefix.setdefault(block_hash, prefix) == prefix, "hash collision"

    # ---- operations ----
    @rule(stem=st.sampled_from(STEMS), stem_len=st.integers(0, 12), suffix=st.lists(TOKEN, max_size=6),
          chunk=st.integers(1, 16), use_cache=st.booleans(), token=TOKEN)
    def admit(self, stem: tuple[int, ...], stem_len: int, suffix: list[int], chunk: int, use_cache: bool,
              token: int) -> None:
        """A new request: take its cached prefix (the last token is always computed), then a first chunk."""
        tokens = list(stem[:stem_len]) + suffix
        if not tokens:
            return
        request = FakeRequest(f"r{self.next_id}", tokens)
        self.next_id += 1
        cached, num_cached = self.kv.get_computed_blocks(request, request.num_tokens - 1) if use_cache else ([], 0)
        num_hit = len(cached) // len(self.windows)  # the hit's blocks come group after group, as many each
        assert num_cached == num_hit * self.block_size < request.num_tokens
        assert len(cached) == num_hit * len(self.windows)
        self._record_hashes(request)
        for j, block in enumerate(cached):  # a hit is a block holding exactly this prefix
            group, i = divmod(j, num_hit)
            window = self.windows[group]
            if block.block_id == self.null_id:  # (a window's hit: a block no query will read)
                assert window is not None and i < (num_cached - window + 1) // self.block_size
                continue
            assert block.block_hash == group_block_hash(request.block_hashes[i], group)
            assert self.slots[block.block_id][-1] == tuple(tokens[:(i + 1) * self.block_size])
        num_new = min(chunk, request.num_tokens - num_cached)
        if self._schedule(request, num_new, cached):
            self.kv.record_prefix_query(request.num_tokens, num_cached)
            self.requests[request.request_id] = request
            self._maybe_sample(request, token)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 99), chunk=st.integers(1, 8), token=TOKEN)
    def step(self, index: int, chunk: int, token: int) -> None:
        """Compute the next prompt chunk, or the one decode token."""
        request = self._pick(index)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self._schedule(request, num_new):  # refused: it waits (the free rule makes room)
            self._maybe_sample(request, token)

    def _maybe_sample(self, request: FakeRequest, token: int) -> None:
        """A step that reached the last token samples the next one, whose KV the next step computes."""
        if request.num_computed_tokens == request.num_tokens:
            request.tokens.append(token)

    @precondition(lambda self: self.requests and self.null_id is None)
    @rule(index=st.integers(0, 99), drafts=st.lists(TOKEN, min_size=1, max_size=4), num_accepted=st.integers(0, 4),
          bonus=TOKEN)
    def speculate(self, index: int, drafts: list[int], num_accepted: int, bonus: int) -> None:
        """Verify draft tokens, accept a prefix of them, roll back the KV of the rest (trim)."""
        request = self._pick(index)
        if request.num_computed_tokens != request.num_tokens - 1:
            return  # only a request in decode (its last sampled token not yet computed) speculates
        final = request.num_tokens
        request.spec_token_ids = list(drafts)  # written this step, but not cacheable
        ok = self._schedule(request, 1 + len(drafts), num_cacheable=final)
        request.spec_token_ids = []
        if not ok:
            return
        num_accepted = min(num_accepted, len(drafts))
        request.tokens.extend(drafts[:num_accepted] + [bonus])
        request.num_computed_tokens = final + num_accepted
        self.kv.trim(request)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 99), then_reset=st.booleans())
    def free(self, index: int, then_reset: bool) -> None:
        """Finish a request; then maybe reset the prefix cache (refused unless every block is free)."""
        request = self._pick(index)
        tables = [list(g.req_to_blocks.get(request.request_id, ())) for g in self.kv.groups]
        queue_before = free_ids(self.kv.pool)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        # Freed blocks join the tail (most recent), group by group, the request's tail block first.
        newly_free = [b.block_id for blocks in tables for b in reversed(blocks) if b.ref_cnt == 0]
        assert free_ids(self.kv.pool) == queue_before + newly_free
        if then_reset:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        idle = self.kv.pool.num_free_blocks == self.kv.pool.num_usable_blocks
        before = self._snapshot()
        ok = self.kv.reset_prefix_cache()
        assert ok == idle, "reset succeeds exactly when no block is in use"
        if ok:
            assert self.kv.pool.num_cached_blocks == 0
            assert all(b.block_hash is None for b in self.kv.pool.blocks)
        else:
            assert self._snapshot() == before

    def teardown(self) -> None:
        """Every request finishing or aborted gives back every block of every group: nothing leaks."""
        if not hasattr(self, "kv"):
            return
        for request_id in list(self.requests):
            self.kv.free(request_id)
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_usable_blocks
        assert all(not g.req_to_blocks and not g.num_skipped_blocks for g in self.kv.groups)

    # ---- invariants ----
    @invariant()
    def block_invariants(self) -> None:
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        assert pool.num_blocks == self.num_blocks == len(pool.blocks)
        assert [b.block_id for b in pool.blocks] == list(range(self.num_blocks))
        holders = [0] * self.num_blocks
        for group in self.kv.groups:
            # the id tables the scheduler hands out are the block tables, kept in step
            assert group.req_to_block_ids == {request_id: [b.block_id for b in blocks]
                                              for request_id, blocks in group.req_to_blocks.items()}
            assert set(group.req_to_blocks) == set(self.kv.req_to_blocks), "a request has a table in every group"
            for request_id, blocks in group.req_to_blocks.items():
                num_skipped = group.num_skipped_blocks.get(request_id, 0)
                assert all(b.block_id == self.null_id for b in blocks[:num_skipped])
                blocks = blocks[num_skipped:]
                ids = [b.block_id for b in blocks]
                assert len(ids) == len(set(ids)), "a block appears twice in one block table"
                for block in blocks:
                    assert pool.blocks[block.block_id] is block and block.block_id != self.null_id
                    holders[block.block_id] += 1
        if self.null_id is not None:  # held by the pool alone, never hashed
            holders[self.null_id] = 1
            assert pool.blocks[self.null_id].block_hash is None
        assert [b.ref_cnt for b in pool.blocks] == holders, "ref count != number of tables holding the block"
        free = free_ids(pool)
        assert len(pool.free_queue) == len(free) == len(set(free))
        assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert all(pool.blocks[b.block_id] is b for b in pool.free_queue)
        assert pool.free_queue.check_links(), "the free queue's links disagree"
        assert not any(b in pool.free_queue for b in pool.blocks if b.ref_cnt > 0)
        for block_hash, holders in pool.cached_blocks.items():
            assert holders, "a hash with no block left is dropped"
            for block_id, block in holders.items():
                assert block.block_hash == block_hash and pool.blocks[block_id] is block
        hashed = [block for block in pool.blocks if block.block_hash is not None]
        for block in hashed:
            assert pool.cached_blocks[block.block_hash][block.block_id] is block, "every hashed block is found"
        assert pool.num_cached_blocks == len(hashed)
        if not self.kv.enable_caching:
            assert not pool.cached_blocks

    @invariant()
    def runner_tables_follow_the_changes(self) -> None:
        """Applying each take_table_changes() to a copy keeps every live table's entries exact."""
        if not hasattr(self, "kv"):
            return
        changes = self.kv.take_table_changes() or [{}] * len(self.windows)
        assert len(changes) == len(self.windows)
        for group, group_changes in enumerate(changes):
            for request_id, (first, block_ids) in group_changes.items():
                row = self.runner_tables.setdefault((request_id, group), [])
                row.extend([-1] * max(0, first + len(block_ids) - len(row)))
                row[first:first + len(block_ids)] = block_ids
        for group, tables in enumerate(self.kv.groups):
            for request_id, block_ids in tables.req_to_block_ids.items():
                assert self.runner_tables.get((request_id, group), [])[:len(block_ids)] == block_ids

    @invariant()
    def contents(self) -> None:
        """Every request reads its own prefix through its block table; cached blocks hold their tokens."""
        if not hasattr(self, "kv"):
            return
        bs = self.block_size
        assert set(self.kv.req_to_blocks) == set(self.requests)
        for request in self.requests.values():
            for group, window in zip(self.kv.groups, self.windows):
                table = group.req_to_blocks.get(request.request_id, [])
                assert len(table) == cdiv(request.num_computed_tokens, bs)
                # With a window, the positions the next query (at num_computed_tokens) can see.
                first = 0 if window is None else max(0, request.num_computed_tokens - window + 1)
                for pos in range(first, request.num_computed_tokens):
                    got = self.slots[table[pos // bs].block_id][pos % bs]
                    assert got == tuple(request.tokens[:pos + 1]), f"{request.request_id} position {pos}"
        for block_hash, holders in self.kv.pool.cached_blocks.items():
            prefix = self.hash_prefix[block_hash[:len(NONE_HASH)]]  # (less a group's suffix)
            start = len(prefix) - bs
            for block in holders.values():
                assert self.slots[block.block_id] == [prefix[:start + j + 1] for j in range(bs)]


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVCacheManager = KVCacheMachine.TestCase


class SlidingKVCacheMachine(KVCacheMachine):
    SLIDING = True


SlidingKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
TestSlidingWindowKVCacheManager = SlidingKVCacheMachine.TestCase


class HybridKVCacheMachine(KVCacheMachine):
    HYBRID = True


HybridKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
TestHybridKVCacheManager = HybridKVCacheMachine.TestCase


def test_blocks_are_registered_once_and_a_content_computed_twice_is_cached_twice() -> None:
    """Each step registers only the blocks that became full since the last one. A block whose content
    another block already holds is registered beside it (nothing is refused, so nothing has to be
    offered again every step); hits prefer the copy in use, and evicting one copy leaves the other."""
    bs = 2
    kv = KVCacheManager(num_blocks=4, block_size=bs, enable_caching=True)
    first = FakeRequest("a", [1, 2, 3])
    assert kv.allocate_slots(first, 3)
    first.num_computed_tokens = 3
    kv.free("a")  # its block [1, 2] stays cached while it waits in the free queue
    (held,) = kv.pool.cached_blocks[first.block_hashes[0]].values()
    second = FakeRequest("b", [1, 2, 3])  # computes its own copy of [1, 2] (a capped or logprobs prompt)
    assert kv.allocate_slots(second, 3)
    second.num_computed_tokens = 3
    own = kv.req_to_blocks["b"][0]
    assert own is not held and own.block_hash == held.block_hash and kv.num_cached_blocks["b"] == 1
    assert kv.pool.cached_blocks[first.block_hashes[0]] == {held.block_id: held, own.block_id: own}
    assert kv.pool.get_cached_block(first.block_hashes[0]) is own  # the copy in use, not the idle one
    # Taking every free block evicts the idle copy; the running request's copy still serves hits.
    kv.pool.get_new_blocks(kv.num_free_blocks)
    assert kv.pool.cached_blocks[first.block_hashes[0]] == {own.block_id: own}
    second.tokens.append(4)
    offered = []
    cache_block = kv.pool.cache_block
    kv.pool.cache_block = lambda block, block_hash: offered.append(block.block_id) or cache_block(block, block_hash)
    assert kv.allocate_slots(second, 1) is True
    assert offered == [kv.req_to_blocks["b"][1].block_id]  # only the block that just filled
    assert kv.pool.get_cached_block(second.block_hashes[1]) is kv.req_to_blocks["b"][1]
    assert kv.num_cached_blocks["b"] == 2


def test_a_dropped_pool_goes_by_reference_counting_alone() -> None:
    """An engine's start-up heap is hidden from the cyclic collector (gc.freeze), so a pool must hold no
    reference cycles: blocks never refer to each other, and a dropped pool is freed at once."""
    pool = BlockPool(6, enable_caching=True, reserve_null_block=True)
    pool.get_new_blocks(2)
    assert not any(isinstance(referent, KVCacheBlock) for block in pool.blocks for referent in gc.get_referents(block))
    gone = weakref.ref(pool)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del pool
        assert gone() is None
    finally:
        if was_enabled:
            gc.enable()


def test_sliding_window_gives_back_the_blocks_behind_it() -> None:
    """Window 6, blocks of 4: a query at position n reads n - 5 .. n, so blocks wholly before n - 5 go back
    to the pool before the next allocation, the null block in their place; they keep their hashes."""
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, sliding_window=6)
    null = kv.null_block.block_id
    request = FakeRequest("a", list(range(30)))
    assert kv.allocate_slots(request, 16)
    request.num_computed_tokens = 16
    assert kv.num_live_blocks("a") == 4 and kv.num_window_freed_blocks == 0
    assert kv.allocate_slots(request, 14)  # the chunk's first query (16) sees 11 on: blocks 0, 1 are dead
    request.num_computed_tokens = 30
    assert kv.req_to_block_ids["a"][:2] == [null, null] and null not in kv.req_to_block_ids["a"][2:]
    assert kv.num_live_blocks("a") == 6
    request.tokens.append(7)
    assert kv.allocate_slots(request, 1)  # decode at 30 sees 25 on: blocks 0-5 dead, 6 and 7 live
    assert kv.num_live_blocks("a") == 2 == cdiv(6, 4) and kv.num_window_freed_blocks == 6
    assert kv.take_table_changes()[0]["a"][1][:6] == [null] * 6
    # Freed, not forgotten: a request with the same prefix hits 28 tokens, the window's blocks (5, 6) real.
    blocks, num_cached = kv.get_computed_blocks(FakeRequest("b", list(range(30))), 29)
    assert num_cached == 28 and [b.block_id for b in blocks][:5] == [null] * 5
    assert null not in [b.block_id for b in blocks[5:]]
    kv.free("a")
    assert kv.num_free_blocks == kv.pool.num_usable_blocks == 9 and kv.reset_prefix_cache()


def test_a_sliding_window_hit_needs_only_the_blocks_in_the_window() -> None:
    """Window 6, blocks of 4: the query at 28 sees 23 on, i.e. blocks 5 and 6. With blocks 0-2 evicted a
    request still hits 28 tokens: the null block stands in for blocks 0-4, which it never reads."""
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, sliding_window=6)
    null = kv.null_block
    first = FakeRequest("a", list(range(30)))
    assert kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.free("a")
    for block_hash in first.block_hashes[:3]:  # evicted since
        for block in list(kv.pool.cached_blocks[block_hash].values()):
            kv.pool.uncache_block(block)
    second = FakeRequest("b", list(range(30)))
    blocks, num_cached = kv.get_computed_blocks(second, 29)
    assert num_cached == 28 and blocks[:5] == [null] * 5 and null not in blocks[5:]
    assert kv.allocate_slots(second, 2, blocks)
    second.num_computed_tokens = 30
    assert kv.num_live_blocks("b") == 3 and null.ref_cnt == 1  # blocks 5, 6 and the new 7
    assert kv.req_to_block_ids["b"][:5] == [null.block_id] * 5
    # Without the window's last block cached, the hit stops before it.
    kv.free("b")
    for block in list(kv.pool.cached_blocks[first.block_hashes[5]].values()):
        kv.pool.uncache_block(block)
    _, num_cached = kv.get_computed_blocks(FakeRequest("c", list(range(30))), 29)
    assert num_cached == 20  # blocks 3, 4 cover what the query at 20 sees (15 on)
    kv.free("c")
