"""The worker half of the ZeroMQ connector: blocks as raw bytes over pyzmq.

Why ZeroMQ rather than torch.distributed point-to-point: a disaggregated deployment is a changing set
of independent instances that a router pairs per request. torch.distributed needs a fixed world, a
rendezvous and matched send/recv on both sides, and a peer that dies leaves the other blocked inside a
collective; ZeroMQ lets any consumer pull from any producer by address, carries the control message
and the bytes on one socket, and every receive can time out, which is what turns a dead producer into
a recompute instead of a hang. On CUDA the bytes go through host memory (NCCL or NIXL would move them
GPU to GPU; that is a transport for later behind the same interface).

Producer: after the forward pass that completes a prompt, `save_kv_layer` copies each layer's blocks of
the request, block-major (so any run of blocks is one contiguous slice), into a staging area capped at
kv_buffer_size bytes; the request's own blocks are freed as usual. A ROUTER socket, served by one
thread, answers pulls: one message per layer, [header JSON, one frame per tensor]. A request's staged
blocks are dropped once pulled, or after staging_ttl_s.

Consumer: `start_load_kv` hands each load to a thread pool; a DEALER socket asks the producer for the
request's blocks from `first_block` on (blocks the consumer's prefix cache held are never asked for),
and each layer is written into the local blocks as it arrives. The scheduler keeps the request out of
the running batch meanwhile, so other requests go on decoding.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq

from pagedllm.distributed.kv_transfer.base import (
    BLOCK_DIM,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorWorker,
    KVTransfer,
    LoadSpec,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

# A received frame is read-only memory; torch.frombuffer warns about that, but each chunk is only read
# (copied into the cache), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

MAX_CONCURRENT_LOADS = 4
POLL_MS = 100


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, seen as the widest integer type that divides a row: still the raw bytes, but
    copies move 8 of them per element instead of one, not a byte at a time."""
    raw = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if raw.shape[-1] % dtype.itemsize == 0 and raw.storage_offset() % dtype.itemsize == 0:
            return raw.view(dtype)
    return raw


def _byte_shape(tensor: torch.Tensor) -> list[int]:
    return [*tensor.shape[:-1], tensor.shape[-1] * tensor.dtype.itemsize]


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in the list, first block id, length) of each run of consecutive block ids: a run is
    one strided slice copy rather than a gather."""
    runs: list[tuple[int, int, int]] = []
    for i, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, block_id, 1))
    return runs


@dataclass
class StagedRequest:
    layers: list[list[torch.Tensor]]  # per layer, per tensor: [num_blocks, ...] raw bytes, block-major
    num_bytes: int
    expires_at: float


class ZmqConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, device: torch.device):
        self.config = config
        self.device = device
        self.layers: list[list[torch.Tensor]] = []
        self.context = zmq.Context()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._finished = KVConnectorOutput()
        self._staged: dict[str, StagedRequest] = {}
        self._staging: dict[str, list[list[torch.Tensor]]] = {}  # saves of the current step, layer by layer
        self._num_loading = 0
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._loads = ThreadPoolExecutor(MAX_CONCURRENT_LOADS, thread_name_prefix="kv-load")
        if config.is_kv_producer:
            socket = self.context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
            except zmq.ZMQError as exc:
                socket.close()
                raise ValueError(f"kv_transfer_config: cannot serve KV blocks on {config.kv_ip}:{config.kv_port} "
                                 f"({exc}); choose another kv_port.") from None
            self._server = threading.Thread(target=self._serve, args=(socket,), name="kv-server", daemon=True)
            self._server.start()
            logger.info("KV producer: serving saved blocks on tcp://%s:%d", config.kv_ip, config.kv_port)

    def register_kv_caches(self, layers: list[list[torch.Tensor]]) -> None:
        self.layers = layers

    # ---- producer ----
    def save_kv_layer(self, layer: int, metadata: KVConnectorMetadata) -> None:
        for spec in metadata.reqs_to_save:
            saved = []
            for tensor in self.layers[layer]:
                raw = _raw(tensor).movedim(BLOCK_DIM, 0)  # block-major view, no copy
                staged = torch.empty((len(spec.block_ids), *raw.shape[1:]), dtype=raw.dtype)
                for index, first, count in _runs(spec.block_ids):
                    staged[index:index + count].copy_(raw[first:first + count])
                saved.append(staged)
            self._staging.setdefault(spec.request_id, []).append(saved)

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        now = time.monotonic()
        with self._lock:
            for spec in metadata.reqs_to_save:
                layers = self._staging.pop(spec.request_id)
                num_bytes = sum(t.numel() * t.element_size() for tensors in layers for t in tensors)
                self._expire(now, need=num_bytes)
                if self._staged_bytes() + num_bytes > self.config.kv_buffer_size:
                    # Full of blocks nobody has pulled yet: this request's consumer recomputes instead.
                    logger.warning("KV staging full (%d bytes): request %s is not saved", self._staged_bytes(),
                                   spec.request_id)
                    self._finished.failed_saving.add(spec.request_id)
                    continue
                self._staged[spec.request_id] = StagedRequest(layers, num_bytes, now + self.config.staging_ttl_s)
                self._finished.finished_saving.add(spec.request_id)

    def staging_stats(self) -> tuple[int, int]:
        with self._lock:
            return len(self._staged), self._staged_bytes()

    def _staged_bytes(self) -> int:
        return sum(s.num_bytes for s in self._staged.values())

    def _expire(self, now: float, need: int = 0) -> None:
        """Drop staged requests past their time; then, to make room for `need` bytes, the oldest
        ones (a consumer that comes for them later recomputes). Called with the lock held."""
        for request_id in [r for r, s in self._staged.items() if s.expires_at <= now]:
            logger.info("KV staging: request %s was not pulled within %.0f s; dropped", request_id,
                        self.config.staging_ttl_s)
            del self._staged[request_id]
        while self._staged and self._staged_bytes() + need > self.config.kv_buffer_size:
            request_id = next(iter(self._staged))
            logger.warning("KV staging: dropping request %s unpulled to make room", request_id)
            del self._staged[request_id]

    def _serve(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    with self._lock:
                        self._expire(time.monotonic())
                    continue
                identity, *frames = socket.recv_multipart()
                try:
                    pull = json.loads(frames[-1])
                    self._send_blocks(socket, identity, pull)
                except Exception as exc:  # a bad pull must not end the server
                    logger.warning("KV pull failed: %s", exc)
                    error = {"status": "error", "message": str(exc)}
                    socket.send_multipart([identity, b"", json.dumps(error).encode()])
        finally:
            socket.close(linger=0)

    def _send_blocks(self, socket: zmq.Socket, identity: bytes, pull: dict) -> None:
        start = time.perf_counter()
        with self._lock:
            staged = self._staged.pop(pull["request_id"], None)  # one consumer per saved request
        if staged is None:
            raise KeyError(f"no saved blocks for request {pull['request_id']!r} (never saved, already pulled, "
                           "or expired)")
        first, count = pull["first_block"], pull["num_blocks"]
        num_blocks = staged.layers[0][0].shape[0]
        if not 0 <= first and first + count <= num_blocks:
            raise ValueError(f"blocks [{first}, {first + count}) asked, {num_blocks} saved")
        num_bytes = 0
        for layer, tensors in enumerate(staged.layers):
            chunks = [t[first:first + count] for t in tensors]  # block-major: contiguous slices, no copy
            header = {"status": "ok", "layer": layer, "num_layers": len(staged.layers),
                      "shapes": [_byte_shape(c) for c in chunks]}
            socket.send_multipart([identity, b"", json.dumps(header).encode(), *(c.numpy() for c in chunks)],
                                  copy=False)
            num_bytes += sum(c.numel() * c.element_size() for c in chunks)
        with self._lock:
            self._finished.transfers.append(KVTransfer("sent", num_bytes, time.perf_counter() - start))

    # ---- consumer ----
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for spec in metadata.reqs_to_load:
            with self._lock:
                self._num_loading += 1
            self._loads.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        start = time.perf_counter()
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{spec.remote_host}:{spec.remote_port}")
            socket.send_multipart([b"", json.dumps({"request_id": spec.remote_request_id,
                                                    "first_block": spec.first_block,
                                                    "num_blocks": len(spec.block_ids)}).encode()])
            deadline = time.monotonic() + self.config.transfer_timeout_s
            runs = _runs(spec.block_ids)
            num_bytes = 0
            for layer, tensors in enumerate(self.layers):
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not socket.poll(remaining_ms):
                    raise TimeoutError(f"no answer from {spec.remote_host}:{spec.remote_port} within "
                                       f"{self.config.transfer_timeout_s:.0f} s")
                _, header_frame, *frames = socket.recv_multipart(copy=False)
                header = json.loads(header_frame.bytes)
                if header["status"] != "ok":
                    raise RuntimeError(header.get("message", "the producer refused the pull"))
                if header["layer"] != layer or header["num_layers"] != len(self.layers) or len(frames) != len(tensors):
                    raise RuntimeError("the producer's KV cache has another layout (model or layers differ)")
                for tensor, frame, shape in zip(tensors, frames, header["shapes"]):
                    raw = _raw(tensor).movedim(BLOCK_DIM, 0)  # block-major view of this cache
                    expected = [len(spec.block_ids), *_byte_shape(raw)[1:]]
                    if shape != expected:
                        raise RuntimeError(f"the producer's blocks are {shape} bytes, this cache's {expected} "
                                           "(block size, dtype or heads differ)")
                    chunk = torch.frombuffer(frame.buffer, dtype=raw.dtype).view(len(spec.block_ids), *raw.shape[1:])
                    chunk = chunk.to(raw.device)
                    for index, first, count in runs:
                        raw[first:first + count].copy_(chunk[index:index + count])
                    num_bytes += chunk.numel() * chunk.element_size()
            with self._done:
                self._finished.finished_recving.add(spec.request_id)
                self._finished.transfers.append(KVTransfer("received", num_bytes, time.perf_counter() - start))
                self._done.notify_all()
        except Exception as exc:
            logger.warning("KV load of request %s from %s:%d failed (%s); it will be recomputed", spec.request_id,
                           spec.remote_host, spec.remote_port, exc)
            with self._done:
                self._finished.failed_recving.add(spec.request_id)
                self._done.notify_all()
        finally:
            socket.close(linger=0)
            with self._lock:
                self._num_loading -= 1

    # ---- both ----
    def get_finished(self, wait: bool) -> KVConnectorOutput:
        with self._done:
            finished = self._finished
            if wait and self._num_loading and not (finished.finished_recving or finished.failed_recving):
                self._done.wait(timeout=POLL_MS / 1000)
            self._finished = KVConnectorOutput()
        return finished

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2 * POLL_MS / 1000)
        self._loads.shutdown(wait=True, cancel_futures=True)
        self.context.term()
