"""The scheduler half of the ZeroMQ connector: which tokens to load, which blocks to save, and the
kv_transfer_params that tell a decode instance where to pull them (vLLM's NixlConnector flow):

1. the router sends the prompt to a producer with {"do_remote_decode": true} and max_tokens=1;
2. when the step that completes the prompt has run, the producer's worker keeps a copy of the prompt's
   blocks, and the response carries {"do_remote_prefill": true, "remote_host", "remote_port",
   "remote_request_id", "remote_num_tokens", "remote_prompt_digest"};
3. the router sends the original request with those params to a consumer, whose scheduler takes the
   prompt's cached prefix from its own prefix cache and asks this connector for the rest: every prompt
   token but the last, whose logits the consumer computes itself (so its first token, sampled with its
   own seed and penalties, is exactly what one instance would have sampled).
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from typing import Any

from pagedllm.distributed.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    LoadSpec,
    SaveSpec,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig

# Seconds; from a same-host copy of a few blocks to a slow link's long prompt.
KV_TRANSFER_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Names the exact prompt whose KV was saved: a consumer whose tokenization differs (another chat
    template, another tokenizer) must not reuse it."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ZmqConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        host = config.kv_ip
        self.advertised_host = socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "") else host
        self._load_tried: set[str] = set()     # one load attempt per request; a failure recomputes
        self._pending_loads: list[LoadSpec] = []
        self._save_scheduled: set[str] = set()
        self._saved: set[str] = set()
        # metrics
        self.bytes_total = {"sent": 0, "received": 0}
        self.seconds_bucket_counts = [0] * (len(KV_TRANSFER_SECONDS_BUCKETS) + 1)
        self.seconds_sum = 0.0
        self.seconds_count = 0
        self.num_fallbacks = 0

    # ---- consumer ----
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   max_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if (not self.config.is_kv_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._load_tried):
            return 0, False
        self._load_tried.add(request.request_id)
        host, port = params.get("remote_host"), params.get("remote_port")
        remote_id, num_tokens = params.get("remote_request_id"), params.get("remote_num_tokens")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(remote_id, str)
                and isinstance(num_tokens, int)) or params.get("remote_prompt_digest") != \
                prompt_digest(request.prompt_token_ids[:num_tokens]):
            self.num_fallbacks += 1  # unusable params (or another prompt): compute it here
            return 0, False
        count = min(max_tokens, num_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        first = request.num_computed_tokens // self.block_size
        last = _cdiv(request.num_computed_tokens + num_external_tokens, self.block_size)
        self._pending_loads.append(LoadSpec(
            request_id=request.request_id, remote_host=params["remote_host"], remote_port=params["remote_port"],
            remote_request_id=params["remote_request_id"], first_block=first, block_ids=list(block_ids[first:last])))

    def record_fallback(self) -> None:
        self.num_fallbacks += 1

    # ---- both ----
    def build_connector_meta(self, scheduled: Sequence[Any]) -> KVConnectorMetadata:
        loads, self._pending_loads = self._pending_loads, []
        saves = []
        if self.config.is_kv_producer:
            for item in scheduled:
                request = item.request
                params = request.kv_transfer_params
                if (params and params.get("do_remote_decode") and request.request_id not in self._save_scheduled
                        and item.start_pos + item.num_new_tokens >= request.num_prompt_tokens):
                    self._save_scheduled.add(request.request_id)
                    num_blocks = _cdiv(request.num_prompt_tokens, self.block_size)
                    saves.append(SaveSpec(request.request_id, list(item.block_ids[:num_blocks]),
                                          request.num_prompt_tokens))
        return KVConnectorMetadata(reqs_to_load=loads, reqs_to_save=saves)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._saved |= output.finished_saving
        for transfer in output.transfers:
            self.bytes_total[transfer.direction] += transfer.num_bytes
            if transfer.direction == "received":
                self.seconds_sum += transfer.seconds
                self.seconds_count += 1
                index = next((i for i, bound in enumerate(KV_TRANSFER_SECONDS_BUCKETS) if transfer.seconds <= bound),
                             len(KV_TRANSFER_SECONDS_BUCKETS))
                self.seconds_bucket_counts[index] += 1

    # ---- producer ----
    def request_finished(self, request: Any) -> dict[str, Any] | None:
        request_id = request.request_id
        self._load_tried.discard(request_id)
        self._save_scheduled.discard(request_id)
        if request_id not in self._saved:
            return None
        self._saved.discard(request_id)
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.config.engine_id,
                "remote_host": self.advertised_host, "remote_port": self.config.kv_port,
                "remote_request_id": request_id, "remote_num_tokens": request.num_prompt_tokens,
                "remote_prompt_digest": prompt_digest(request.prompt_token_ids)}
