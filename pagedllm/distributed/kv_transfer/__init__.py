"""Disaggregated prefill and decode: KV connectors that move a request's blocks between instances."""

from __future__ import annotations

from pagedllm.distributed.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig

__all__ = ["KVConnectorMetadata", "KVConnectorOutput", "KVConnectorScheduler", "KVConnectorWorker",
           "KVTransferConfig", "make_scheduler_connector", "make_worker_connector"]


def make_scheduler_connector(config: KVTransferConfig, block_size: int) -> KVConnectorScheduler:
    from pagedllm.distributed.kv_transfer.scheduler_side import ZmqConnectorScheduler

    return ZmqConnectorScheduler(config, block_size)


def make_worker_connector(config: KVTransferConfig, device) -> KVConnectorWorker:
    from pagedllm.distributed.kv_transfer.zmq_connector import ZmqConnectorWorker

    return ZmqConnectorWorker(config, device)
