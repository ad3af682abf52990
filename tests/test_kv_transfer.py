"""KV connector (disaggregated prefill) at the engine level: a producer LLM and a consumer LLM in one
process, the blocks going between them over ZeroMQ exactly as between two servers."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.kv_transfer import KVTransferConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.executor.multiproc import get_open_port
from pagedllm.metrics.reader import as_dict

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    port = get_open_port()
    common = dict(block_size=BLOCK_SIZE, num_gpu_blocks_override=256, max_model_len=256)
    producer = LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_producer", "kv_port": port}, **common)
    consumer = LLM(tiny_llama_dir, kv_transfer_config={
        "kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout_s": 2}}, **common)
    yield producer, consumer
    producer.llm_engine.shutdown()
    consumer.llm_engine.shutdown()


def _params(**kwargs) -> SamplingParams:
    kv = kwargs.pop("kv_transfer_params", None)
    return SamplingParams(**kwargs, extra_args={"kv_transfer_params": kv} if kv else None)


def _prefill(producer: LLM, prompt: list[int]) -> dict:
    [out] = producer.generate([prompt], _params(max_tokens=1, temperature=0.0,
                                                kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    params = out.kv_transfer_params
    assert params is not None and params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt)
    return params


def _metrics(llm: LLM) -> dict[str, float]:
    return as_dict(llm.llm_engine.get_metrics())


def _bytes_received(llm: LLM) -> int:
    return llm.llm_engine.kv_connector.bytes_total["received"]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7, top_k=20)])
def test_decode_from_transferred_kv_equals_one_instance(pair, sampling):
    producer, consumer = pair
    prompt = list(range(3, 3 + 23))  # 23 tokens: five full blocks and a partial one
    [alone] = consumer.generate([prompt], _params(max_tokens=12, **sampling), use_tqdm=False)
    consumer.llm_engine.reset_prefix_cache()  # the transferred run must not find the prompt cached
    params = _prefill(producer, prompt)
    before = _bytes_received(consumer)
    [out] = consumer.generate([prompt], _params(max_tokens=12, kv_transfer_params=params, **sampling),
                              use_tqdm=False)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    per_block = consumer.llm_engine.model_runner.kv_cache_bytes_per_block()
    assert _bytes_received(consumer) - before == 6 * per_block  # tokens 0..21: six blocks, nothing else
    assert _metrics(consumer)["pagedllm:num_requests_waiting_for_kv"] == 0


def test_prefix_held_by_the_consumer_is_not_sent(pair):
    producer, consumer = pair
    consumer.llm_engine.reset_prefix_cache()
    shared = list(range(100, 116))  # four full blocks
    first, second = shared + [7, 8, 9, 10, 11], shared + [20, 21, 22, 23, 24]
    per_block = consumer.llm_engine.model_runner.kv_cache_bytes_per_block()
    for prompt, blocks_sent in ((first, 5), (second, 1)):  # the second sends only the block past the prefix
        params = _prefill(producer, prompt)
        before = _bytes_received(consumer)
        [out] = consumer.generate([prompt], _params(max_tokens=4, temperature=0.0, kv_transfer_params=params),
                                  use_tqdm=False)
        assert _bytes_received(consumer) - before == blocks_sent * per_block
        [alone] = producer.generate([prompt], _params(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("breakage", ["unknown_request", "dead_producer", "other_prompt"])
def test_failed_transfer_recomputes_the_prompt(pair, breakage):
    producer, consumer = pair
    prompt = list(range(40, 58))
    params = _prefill(producer, prompt)
    if breakage == "unknown_request":
        params = {**params, "remote_request_id": "no-such-request"}
    elif breakage == "dead_producer":
        params = {**params, "remote_port": get_open_port()}  # nothing listens there: the pull times out
    else:
        prompt = prompt[:-1] + [prompt[-1] + 1]
    fallbacks = _metrics(consumer)["pagedllm:kv_transfer_fallbacks"]
    consumer.llm_engine.reset_prefix_cache()
    [out] = consumer.generate([prompt], _params(max_tokens=6, temperature=0.0, kv_transfer_params=params),
                              use_tqdm=False)
    [alone] = producer.generate([prompt], _params(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert _metrics(consumer)["pagedllm:kv_transfer_fallbacks"] == fallbacks + 1
    kv = consumer.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_pools_free_and_nothing_staged_after_a_batch(pair):
    producer, consumer = pair
    prompts = [[5 + i] * (9 + 3 * i) for i in range(6)]
    staged = _metrics(producer)["pagedllm:kv_transfer_staged_requests"]  # left unpulled by the tests above
    params = [_prefill(producer, p) for p in prompts]
    outs = consumer.generate(prompts, [_params(max_tokens=5, temperature=0.0, kv_transfer_params=p) for p in params],
                             use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    for llm in pair:
        kv = llm.llm_engine.kv_cache_manager
        assert kv.num_free_blocks == kv.pool.num_blocks and not kv.req_to_blocks
    assert _metrics(producer)["pagedllm:kv_transfer_staged_requests"] == staged  # every one pulled once


def test_one_byte_kv_travels_with_its_scales(tiny_llama_dir):
    """fp8 codes and each token's bf16 scale share the block: moving the block moves both."""
    common = dict(block_size=BLOCK_SIZE, num_gpu_blocks_override=64, max_model_len=128, kv_cache_dtype="fp8")
    producer = LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_producer", "kv_port": get_open_port()},
                   **common)
    consumer = LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_consumer"}, **common)
    try:
        prompt = list(range(60, 79))
        [alone] = consumer.generate([prompt], _params(max_tokens=8, temperature=0.0), use_tqdm=False)
        consumer.llm_engine.reset_prefix_cache()
        params = _prefill(producer, prompt)
        [out] = consumer.generate([prompt], _params(max_tokens=8, temperature=0.0, kv_transfer_params=params),
                                  use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert _bytes_received(consumer) == 5 * consumer.llm_engine.model_runner.kv_cache_bytes_per_block()
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


def test_kv_transfer_config_is_validated():
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_any({"kv_role": "kv_sender"})
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_any("{}")
    with pytest.raises(ValueError, match="unknown key"):
        KVTransferConfig.from_any({"kv_role": "kv_both", "kv_rank": 0})
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        KVTransferConfig.from_any({"kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout_s": 0}})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineArgs(model="x", kv_transfer_config="{kv_role")
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        EngineArgs(model="x", kv_transfer_config={"kv_role": "kv_both"}, kv_cache_dtype="fp8",
                   calculate_kv_scales=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineArgs(model="x", kv_transfer_config={"kv_role": "kv_both"}, tensor_parallel_size=2)
