"""The KV-cache snapshot behind GET /kv-cache/state (issue 18), on the engine itself.

After every step of a real load (shared prefixes, parallel sampling n > 1, aborts, and a pool small
enough to preempt) the snapshot's JSON keeps its invariants: the runs tile the pool; every block's
ref count equals the number of block tables that hold it; the (block, request) pairs seen from the
blocks equal those seen from the requests' block tables; used + free = total; and its free count
equals the Prometheus gauge `pagedllm:kv_cache_free_blocks` read at the same moment. The same checks
run against the real server in test_kv_cache_page.py, so they live here as `check_kv_state`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import random_prompts

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_cache.manager import KVCacheManager, cdiv

BLOCK = 16


def expand_blocks(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The run-length encoded `blocks` as one entry per block id (and a check that runs tile the pool)."""
    blocks: list[dict[str, Any]] = []
    for run in state["blocks"]:
        assert run["id"] == len(blocks), "runs must be consecutive and cover the pool in id order"
        assert run["count"] >= 1
        blocks.extend({**run, "id": run["id"] + i} for i in range(run["count"]))
    assert len(blocks) == state["num_blocks"]
    return blocks


def check_kv_state(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every invariant of one /kv-cache/state JSON; returns the expanded blocks."""
    blocks = expand_blocks(state)
    for block in blocks:
        assert block["state"] in ("free", "cached", "used")
        assert (block["state"] == "used") == (block["ref_cnt"] > 0), block
        assert block["ref_cnt"] == len(block["request_ids"]), f"ref count != block tables holding it: {block}"
        assert len(set(block["request_ids"])) == len(block["request_ids"])
    # the same sharing seen from both sides
    from_blocks = Counter((block["id"], rid) for block in blocks for rid in block["request_ids"])
    from_tables = Counter((block_id, r["request_id"]) for r in state["requests"] for block_id in r["block_table"])
    assert from_blocks == from_tables, "blocks' holders and requests' block tables disagree"
    by_state = Counter(block["state"] for block in blocks)
    assert state["num_blocks_by_state"] == {s: by_state[s] for s in ("free", "cached", "used")}
    assert by_state["used"] + state["num_free_blocks"] == state["num_blocks"], "used + free != total"
    assert state["num_shared_blocks"] == sum(block["ref_cnt"] > 1 for block in blocks)
    assert 0.0 <= state["prefix_cache_hit_rate"] <= 1.0
    ids = [r["request_id"] for r in state["requests"]]
    assert len(ids) == len(set(ids))
    for request in state["requests"]:
        assert request["status"] in ("waiting", "running", "preempted")
        assert request["num_computed_tokens"] <= request["num_tokens"]
        assert cdiv(request["num_computed_tokens"], state["block_size"]) <= len(request["block_table"])
        if request["status"] != "running":
            assert request["block_table"] == [] and request["num_computed_tokens"] == 0
    return blocks


def gauge(engine: LLMEngine, name: str) -> float:
    return next(m.value for m in engine.get_metrics() if m.name == name)


def test_snapshot_invariants_under_load(tiny_llama_dir: str) -> None:
    engine = LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=256, block_size=BLOCK,
                                  num_gpu_blocks_override=32, max_num_batched_tokens=256, seed=0))
    prefix = random_prompts(1, 512, lengths=[3 * BLOCK + 5], seed=1)[0]
    tails = random_prompts(8, 512, lengths=[3 + i for i in range(8)], seed=2)
    for i, tail in enumerate(tails):  # shared prefix, ignore_eos so they run long enough to overlap
        engine.add_request(f"shared-{i}", prefix + tail, SamplingParams(max_tokens=60 + 8 * i, ignore_eos=True,
                                                                        temperature=0.0))
    for i in range(2):  # parallel sampling: the samples share the prompt's blocks
        engine.add_request(f"n3-{i}", prefix[:2 * BLOCK + 7 * i], SamplingParams(n=3, max_tokens=24, seed=i,
                                                                                  ignore_eos=True))
    seen = Counter()
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == 6:
            engine.abort_request(["shared-1", "n3-1"])
        snapshot = engine.get_kv_cache_snapshot()
        state = snapshot.to_dict()
        blocks = check_kv_state(state)
        # taken on the same thread between the same two steps: the gauge agrees exactly
        assert state["num_free_blocks"] == gauge(engine, "pagedllm:kv_cache_free_blocks")
        assert state["num_blocks"] == gauge(engine, "pagedllm:kv_cache_total_blocks")
        seen["shared"] += state["num_shared_blocks"] > 0
        seen["cached"] += state["num_blocks_by_state"]["cached"] > 0
        seen["children"] += any(r["parent_id"] == "n3-0" for r in state["requests"])
        seen["aborted_gone"] += step > 6 and not any(r["request_id"] in ("shared-1", "n3-1")
                                                     for r in state["requests"])
        siblings = [r for r in state["requests"] if r["parent_id"] == "n3-0" and r["status"] == "running"]
        if len(siblings) == 3:  # the samples' first full prompt block is one physical block
            first = {r["block_table"][0] for r in siblings}
            seen["siblings_share"] += len(first) == 1 and blocks[first.pop()]["ref_cnt"] >= 3
        assert step < 2000
    assert all(seen[key] for key in ("shared", "cached", "children", "aborted_gone", "siblings_share")), seen
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    state = engine.get_kv_cache_snapshot().to_dict()
    check_kv_state(state)
    assert state["num_preemptions"] == engine.scheduler.num_preemptions
    assert state["requests"] == [] and state["num_free_blocks"] == state["num_blocks"]
    assert state["num_blocks_by_state"]["used"] == 0 and state["num_blocks_by_state"]["cached"] > 0
    assert 0.0 < state["prefix_cache_hit_rate"] < 1.0


class FakeRequest:
    """The fields the KV cache manager reads from a request."""

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id, self.num_computed_tokens, self.block_hashes = request_id, 0, []
        self.all_token_ids, self.num_tokens = token_ids, len(token_ids)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "free"]), st.integers(0, 9), st.integers(1, 30)),
                    max_size=30))
def test_runs_are_the_per_block_view(ops: list[tuple[str, int, int]]) -> None:
    """Random admissions (with prefix hits) and frees: the runs expand to exactly the per-block
    view built the slow way, and no two neighbouring runs could have been merged."""
    kv = KVCacheManager(24, 4, enable_caching=True)
    live: list[str] = []
    for number, (op, pick, length) in enumerate(ops):
        if op == "admit":
            request = FakeRequest(f"r{number}", [pick % 3] * 8 + list(range(length)))
            cached, num_cached = kv.get_computed_blocks(request, request.num_tokens - 1)
            if kv.allocate_slots(request, request.num_tokens - num_cached, cached):
                live.append(request.request_id)
        elif live and op == "free":
            kv.free(live.pop(pick % len(live)))
    snapshot = kv.snapshot()
    holders = snapshot.holders()
    expected = [{"id": i, "state": snapshot.block_state(i), "ref_cnt": snapshot.ref_cnts[i],
                 "request_ids": holders.get(i, [])} for i in range(snapshot.num_blocks)]
    state = snapshot.to_dict()
    assert [{k: v for k, v in block.items() if k != "count"} for block in expand_blocks(state)] == expected
    for left, right in zip(state["blocks"], state["blocks"][1:]):
        assert (left["state"], left["ref_cnt"], left["request_ids"]) != \
            (right["state"], right["ref_cnt"], right["request_ids"])
    check_kv_state({**state, "requests": [
        {"request_id": rid, "status": "running", "block_table": table, "num_computed_tokens": 0, "num_tokens": 0}
        for rid, table in snapshot.block_tables.items()]})


def test_runs_summarise_a_large_pool() -> None:
    """100,000 blocks with two requests: a handful of runs, nothing lost."""
    kv = KVCacheManager(100_000, BLOCK, enable_caching=True)
    a = FakeRequest("a", list(range(10 * BLOCK)))
    b = FakeRequest("b", list(range(10 * BLOCK)) + [7] * (3 * BLOCK + 1))
    assert kv.allocate_slots(a, a.num_tokens)
    cached, num_cached = kv.get_computed_blocks(b, b.num_tokens - 1)
    assert num_cached == 10 * BLOCK
    assert kv.allocate_slots(b, b.num_tokens - num_cached, cached)
    state = kv.snapshot().to_dict()
    blocks = check_kv_state({**state, "requests": [
        {"request_id": rid, "status": "running", "block_table": table, "num_computed_tokens": 0, "num_tokens": 0}
        for rid, table in kv.snapshot().block_tables.items()]})
    assert [(run["id"], run["count"], run["state"], run["ref_cnt"]) for run in state["blocks"]] == [
        (0, 10, "used", 2), (10, 4, "used", 1), (14, 100_000 - 14, "free", 0)]
    assert blocks[3]["request_ids"] == ["a", "b"]
    kv.free("b")
    kv.free("a")
    runs = kv.snapshot().to_dict()["blocks"]
    # b's 13 full blocks keep their prefix hashes; its partial last block does not
    assert [(run["id"], run["count"], run["state"]) for run in runs] == [(0, 13, "cached"), (13, 100_000 - 13, "free")]
