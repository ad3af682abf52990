"""The router's choices, without servers: which instance, and what the prefill instance is asked."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.router import InstancePool, Router, prefill_body


def test_round_robin_skips_instances_out_of_rotation():
    pool = InstancePool(["http://a", "http://b/", "http://c"], "decode", "round_robin")
    assert [pool.pick().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    pool.instances[1].healthy = False
    assert {pool.pick().url for _ in range(4)} == {"http://a", "http://c"}
    assert pool.pick(exclude={"http://a", "http://c"}) is None


def test_least_loaded_picks_the_fewest_in_flight():
    pool = InstancePool(["http://a", "http://b"], "prefill", "least_loaded")
    pool.instances[0].in_flight = 3
    assert pool.pick().url == "http://b"
    pool.instances[1].in_flight = 5
    assert pool.pick().url == "http://a"


def test_prefill_request_is_the_prompt_and_one_token():
    body = {"model": "m", "prompt": "hi", "max_tokens": 200, "stream": True, "stream_options": {"include_usage": True},
            "n": 3, "stop": ["\n"], "min_tokens": 5, "logprobs": 2, "temperature": 0.7, "seed": 3}
    cut = prefill_body(body)
    assert cut == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "n": 1, "temperature": 0.7,
                   "seed": 3, "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 200  # the decode instance gets the client's request unchanged


def test_router_arguments_are_validated():
    with pytest.raises(ValueError, match="--decode"):
        Router(["http://a"], [])
    with pytest.raises(ValueError, match="policy"):
        Router([], ["http://b"], policy="random")
