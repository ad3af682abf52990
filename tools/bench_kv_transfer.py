"""The transport alone: a producer LLM and a consumer LLM in one process pull a long prompt's blocks
over ZeroMQ (TCP loopback) again and again; prints each pull's GB/s (bytes / time from asking to the
last layer written into the consumer's cache) and the median and best, next to this machine's memory
copy bandwidth.

    python tools/bench_kv_transfer.py [MODEL_DIR] [PROMPT_TOKENS] [PULLS]
"""

from __future__ import annotations

import statistics
import sys

from pagedllm import LLM, SamplingParams
from pagedllm.executor.multiproc import get_open_port
from pagedllm.planner.hardware import measure_memory_bandwidth


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "pagedllm/assets/models/pycode-target"
    num_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
    num_pulls = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    common = dict(max_model_len=num_tokens + 64, dtype="float32")
    producer = LLM(model, kv_transfer_config={"kv_role": "kv_producer", "kv_port": get_open_port()}, **common)
    consumer = LLM(model, kv_transfer_config={"kv_role": "kv_consumer"}, **common)
    connector = consumer.llm_engine.kv_connector
    rates = []
    for pull in range(num_pulls):
        prompt = [7 + pull] + [5 + i % 300 for i in range(num_tokens)]  # its own first block: nothing cached
        save = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        [out] = producer.generate([prompt], save, use_tqdm=False)
        num_bytes, seconds = connector.bytes_total["received"], connector.seconds_sum
        load = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": out.kv_transfer_params})
        consumer.generate([prompt], load, use_tqdm=False)
        num_bytes, seconds = connector.bytes_total["received"] - num_bytes, connector.seconds_sum - seconds
        rates.append(num_bytes / seconds / 1e9)
        print(f"pull {pull}: {num_bytes / 1e6:.1f} MB in {seconds * 1e3:.1f} ms = {rates[-1]:.2f} GB/s")
    copy = measure_memory_bandwidth() / 1e9
    print(f"median {statistics.median(rates):.2f} GB/s, best {max(rates):.2f} GB/s; memory copy {copy:.1f} GB/s "
          f"(best pull = {max(rates) / copy:.1%} of it)")
    producer.llm_engine.shutdown()
    consumer.llm_engine.shutdown()


if __name__ == "__main__":
    main()
