"""The model runner: turns a SchedulerOutput into tensors, runs one forward pass, samples.

It owns the model, the paged KV cache tensors and the attention backend, and knows nothing of policy.
Under tensor parallelism every rank runs one, on its shard of the weights and KV heads, with the same
inputs; the logits are gathered on rank 0, which alone samples.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backend import AttentionMetadata, PrefillSeq
from pagedllm.attention.selector import get_attn_backend
from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import RunnerRequest, ScheduledRequest, SchedulerOutput
from pagedllm.kv_cache.quant import KV_CACHE_DTYPES, is_quantized, resolve_kv_cache_dtype  # noqa: F401
from pagedllm.layers.sampler import Sampler, SamplingRow, argmax_rows
from pagedllm.models.loader import load_model
from pagedllm.outputs import PositionLogprobs, position_logprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.spec_decoder import SpecDecoder
from pagedllm.structured_output import GrammarBitmask
from pagedllm.worker.block_table import BlockTables
from pagedllm.worker.step_inputs import StepInputs, decode_step_inputs, step_inputs

if TYPE_CHECKING:
    from pagedllm.spec_decode import SpeculativeConfig

logger = logging.getLogger(__name__)

# Requests computing at most this many tokens share one batched attention call (decodes, speculative
# verification, short prompts); longer prefill chunks get a call each.
MAX_BATCHED_QUERY_LEN = 8

@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # the scheduled requests in batch order; None for a continued decode (execute_continued_decode), which
    # is built from the last step's arrays and never reaches sample()
    order: list[ScheduledRequest] | None
    query_starts: list[int]
    request_ids: list[str]    # in batch order
    start_pos: list[int]      # each request's first position this step
    rows: list[int]           # each request's row of the runner's BlockTables
    # every request computes one token, samples it, and takes the argmax of its raw logits (see sample)
    argmax_decode: bool = False
    rows_tensor: torch.Tensor | None = None  # `rows` as a tensor, where a continued decode made one


@dataclass
class _DecodeRun:
    """The last step, when every request it ran computed one token and sampled one: what the next step
    needs to continue it without the requests' lists (prepare's `continuing`; under async scheduling
    execute_continued_decode, for plain-greedy runs only)."""

    request_ids: list[str]
    rows: list[int]
    next_start_pos: list[int]  # each request's position after the step's: where a continuing step starts
    token_ids: list[int]       # sampled: the next step's input ids
    order: list[ScheduledRequest] | None  # the step's scheduled requests (None for a continued one)
    argmax: bool               # every request takes the argmax of its raw logits (Batch.argmax_decode)
    # On the CPU the same numbers as tensors, from which the next step's inputs are built without reading
    # the lists (decode_step_inputs); None elsewhere
    token_tensor: torch.Tensor | None = None
    positions: torch.Tensor | None = None    # the step's positions (the next step's are one on)
    rows_tensor: torch.Tensor | None = None  # made by the first step that continues this run


# vLLM's CPU backend reserves VLLM_CPU_KVCACHE_SPACE GiB (default 4) for the KV cache; ours is the same
# idea under our own name, and the default is also capped by what the engine could ever use.
CPU_KVCACHE_SPACE_ENV = "PAGEDLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 2**30


def cpu_kv_cache_space_bytes() -> int | None:
    """PAGEDLLM_CPU_KVCACHE_SPACE (GiB, fractions allowed) in bytes, or None when unset."""
    gib = envs.value(CPU_KVCACHE_SPACE_ENV)
    if gib is None:
        return None
    if not gib > 0:
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV} must be a positive number of GiB, got {gib!r}.")
    return int(gib * 2**30)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, device: torch.device, seed: int = 0,
                 tp_rank: int = 0, tp_size: int = 1, ranks_per_host: int = 1,
                 speculative_config: SpeculativeConfig | None = None, batch_invariant: bool = True,
                 block_tables: BlockTables | None = None):
        """batch_invariant=False: a draft model's runner (see load_model), which reads the target's
        block_tables (its KV lives in the target's blocks)."""
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ranks_per_host = ranks_per_host  # CPU ranks on one host share its memory
        self.block_size = cache_config.block_size
        self.kv_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, model_config.dtype)
        self.num_kv_heads = model_config.get_num_kv_heads(tp_size)
        # MLA layers attend through their own latent-cache attention (attention/mla.py), which reads the
        # reference backend's padded decode batch and masks: the runner must build those for them.
        backend_name = "TORCH_SDPA" if model_config.is_mla else cache_config.attention_backend
        self.backend = get_attn_backend(backend_name, model_config.num_attention_heads // tp_size,
                                        self.num_kv_heads, model_config.head_dim, model_config.dtype,
                                        self.kv_dtype, device, self.block_size,
                                        calculate_kv_scales=cache_config.calculate_kv_scales)
        self.model = load_model(model_config, self.backend, device, tp_rank, tp_size, batch_invariant)
        # Multi-LoRA: wraps the projections with the batched adapter delta; each step sets its token slots
        self.lora_manager = None
        if model_config.lora_config is not None:
            from pagedllm.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, model_config, model_config.lora_config, device,
                                            tp_rank, tp_size)
        # A one-byte cache with a checkpoint's per-layer k_scale / v_scale (vLLM's fp8 KV checkpoints).
        self.checkpoint_kv_scales = None
        if is_quantized(self.kv_dtype) and not model_config.is_mla and not cache_config.calculate_kv_scales:
            from pagedllm.kv_cache.checkpoint_scales import load_kv_scales

            self.checkpoint_kv_scales = load_kv_scales(model_config.model, model_config.num_hidden_layers,
                                                       self.kv_dtype)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator)
        self.kv_caches: list[torch.Tensor] = []  # per layer
        self.kv_cache_tensors: list[torch.Tensor] = []  # the distinct ones (layers of different groups share)
        # KV cache groups (kv_cache/manager.py): layer i of every group shares cache tensor i, and each
        # group has its own block tables, so each layer attends with its group's metadata.
        groups = cache_config.kv_cache_groups or [(None, list(range(model_config.num_hidden_layers)))]
        self.num_kv_cache_groups = len(groups)
        self.group_of_layer = [0] * model_config.num_hidden_layers
        self.slot_of_layer = list(range(model_config.num_hidden_layers))
        for group, (_, layers) in enumerate(groups):
            for slot, layer in enumerate(layers):
                self.group_of_layer[layer], self.slot_of_layer[layer] = group, slot
        self.num_kv_cache_tensors = len(groups[0][1])
        # every live request's block table, kept from the KV cache manager's changes (the plan carries them)
        self.block_tables = block_tables or BlockTables(scheduler_config.max_num_seqs,
                                                       -(-scheduler_config.max_model_len // self.block_size) + 1,
                                                       num_groups=self.num_kv_cache_groups)
        # One rank: the last step, if every request computed one token and sampled one, kept so that the next
        # can continue it (prepare, given the same requests one token on; under async scheduling, in a worker
        # process, execute_continued_decode, for plain-greedy steps only)
        self._keeps_decode_runs = tp_size == 1
        self._continues_in_prepare = not scheduler_config.async_scheduling
        self._last_decode: _DecodeRun | None = None
        # Disaggregated prefill: saves finished prompts' blocks (producer), loads remote ones (consumer).
        self.kv_connector = None
        kv_transfer_config = cache_config.kv_transfer_config
        if kv_transfer_config is not None:
            from pagedllm.distributed.kv_transfer import make_worker_connector

            self.kv_connector = make_worker_connector(kv_transfer_config, device)
        # Speculative decoding: verifies the k+1 positions of each request and drafts the next proposals.
        # Rank 0 only: it alone sees the logits, and the draft runs there unsharded.
        self.spec_decoder: SpecDecoder | None = None
        self.draft_runner: ModelRunner | None = None
        if speculative_config is not None and tp_rank == 0:
            if speculative_config.method == "draft_model":
                assert speculative_config.draft_model_config is not None
                # The target's block size, prefix caching and attention backend. Not batch-invariant:
                # proposals are verified by the target, so the draft's rounding never reaches an output,
                # and its small projections may take the faster plain matmul.
                draft_cache_config = CacheConfig(block_size=self.block_size,
                                                 enable_prefix_caching=cache_config.enable_prefix_caching,
                                                 attention_backend=cache_config.attention_backend)
                self.draft_runner = ModelRunner(speculative_config.draft_model_config, draft_cache_config,
                                                scheduler_config, device, seed=seed, batch_invariant=False,
                                                block_tables=self.block_tables)
            self.spec_decoder = SpecDecoder(speculative_config, scheduler_config, self.sampler.generator,
                                            model_config.num_hidden_layers, self.weight_bytes(), self.draft_runner)

    def require_lora_manager(self):  # -> LoRAManager
        if self.lora_manager is None:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with enable_lora=True.")
        return self.lora_manager

    # ---- KV cache ----
    def kv_cache_bytes_per_block(self) -> int:
        """A block holds one block of KV for each layer of a KV cache group (all layers with one group)."""
        per_token = self.model_config.kv_bytes_per_token(self.kv_dtype, self.tp_size)
        return per_token // self.model_config.num_hidden_layers * self.num_kv_cache_tensors * self.block_size

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def draft_bytes(self) -> int:
        """The draft model's weights and KV pool on this rank (0 without one)."""
        runner = self.draft_runner
        if runner is None:
            return 0
        return runner.weight_bytes() + sum(c.numel() * c.element_size() for c in runner.kv_cache_tensors)

    def activation_bytes_estimate(self) -> int:
        c = self.model_config
        tokens = self.scheduler_config.max_num_batched_tokens
        per_token = (4 * c.hidden_size + 3 * c.intermediate_size
                     + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim) * 4
        logits = self.scheduler_config.max_num_seqs * c.vocab_size * 4 * 4
        return tokens * per_token + logits

    def determine_num_blocks(self) -> int:
        num_blocks, self.kv_budget_source = self._kv_cache_budget_blocks()
        return num_blocks

    def _kv_cache_budget_blocks(self) -> tuple[int, str]:
        """(number of blocks, where their budget came from, for the start-up line)."""
        cfg = self.cache_config
        per_block = self.kv_cache_bytes_per_block()
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override, "num_gpu_blocks_override"
        # A draft model's KV lives in the target's blocks (a block holds both): its bytes come out of the
        # same budget (its weights are already loaded, so measured memory has them).
        draft_per_block = self.spec_decoder.draft_kv_cache_bytes_per_block() if self.spec_decoder else 0
        max_blocks = None
        if cfg.kv_cache_memory_bytes is not None:
            budget, source = cfg.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif self.device.type == "cuda":
            # What this process freed (an engine dropped before this one) stays reserved by torch's caching
            # allocator and would read as used: give it back before measuring, as vLLM does.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cfg.gpu_memory_utilization) - used - self.activation_bytes_estimate()
            source = (f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                      f"{used / 2**30:.1f} GiB in use")
        elif (space := cpu_kv_cache_space_bytes()) is not None:
            budget, source = space, f"{CPU_KVCACHE_SPACE_ENV}={os.environ[CPU_KVCACHE_SPACE_ENV]} GiB"
        else:
            # On CPU, like vLLM's VLLM_CPU_KVCACHE_SPACE: a fixed default rather than a share of the
            # host, which other processes share and which nothing reserves for us; and never more than
            # every sequence at full length could use, nor more than the memory available now (ranks on
            # one host each take their share of it).
            # (a block holds one KV cache group's layers: a sequence takes blocks in every group)
            max_blocks = (self.scheduler_config.max_num_seqs * self.scheduler_config.max_model_len // self.block_size
                          * self.num_kv_cache_groups + 1)
            available = (int(available_cpu_memory() * cfg.gpu_memory_utilization) // self.ranks_per_host
                         - self.activation_bytes_estimate())
            candidates = {f"the {DEFAULT_CPU_KV_CACHE_BYTES / 2**30:g} GiB default": DEFAULT_CPU_KV_CACHE_BYTES,
                          f"gpu_memory_utilization={cfg.gpu_memory_utilization} of available memory": available}
            source, budget = min(candidates.items(), key=lambda item: item[1])
        num_blocks = budget // (per_block + draft_per_block)
        if max_blocks is not None and num_blocks > max_blocks:
            num_blocks, source = max_blocks, "max_num_seqs x max_model_len"
        if num_blocks <= 0:
            raise ValueError(f"No memory left for the KV cache (budget {budget} bytes from {source}, {per_block} "
                             "bytes per block); raise gpu_memory_utilization or kv_cache_memory_bytes.")
        return int(num_blocks), source

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # Ordinary tensors even when called in inference mode (a worker process serves every call in it):
        # a KV connector's thread writes into the cache outside it.
        with torch.inference_mode(False):
            self._allocate_kv_cache(num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.model_config
        # One tensor for all layers; each layer gets a [2, kv_heads, num_blocks, block_size, head_dim] view
        # (MLA: [1, 1, num_blocks, block_size, latent + rope key], see ModelConfig.kv_cache_layer_shape).
        # Zeroed: masked-out padding is multiplied by 0 in attention, and 0 * NaN garbage would be NaN.
        # One-byte kinds: uint8 tiles of codes followed by their bf16 row scales (kv_cache/quant.py).
        shape = (self.num_kv_cache_tensors, *c.kv_cache_layer_shape(num_blocks, self.block_size, self.tp_size,
                                                                    self.kv_dtype))
        storage_dtype = torch.uint8 if is_quantized(self.kv_dtype) else self.kv_dtype
        if self.device.type == "cpu":
            # calloc'd memory: the OS hands out zero pages on first touch, so start-up does not write
            # (and the process does not hold) gigabytes of cache that no request has used yet.
            nbytes = math.prod(shape) * storage_dtype.itemsize
            cache = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(storage_dtype).view(shape)
        else:
            cache = torch.zeros(shape, dtype=storage_dtype, device=self.device)
        self.kv_cache_tensors = list(cache.unbind(0))
        self.kv_caches = [self.kv_cache_tensors[slot] for slot in self.slot_of_layer]
        if self.checkpoint_kv_scales is not None:
            for layer_cache, scales in zip(self.kv_caches, self.checkpoint_kv_scales):
                self.backend.static_scales[layer_cache.data_ptr()] = scales.to(self.device)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_transfer_tensors())
        if self.spec_decoder is not None:
            self.spec_decoder.allocate(num_blocks)
        rank = f"rank {self.tp_rank}/{self.tp_size}: " if self.tp_size > 1 else ""
        draft = f"; draft weights and KV {_gib(self.draft_bytes())}" if self.draft_bytes() else ""
        num_tokens = num_blocks * self.block_size
        max_model_len = self.scheduler_config.max_model_len
        groups = (f" (each holding {self.num_kv_cache_tensors} layers: {self.num_kv_cache_groups} KV cache groups, "
                  "a sequence takes blocks in each)" if self.num_kv_cache_groups > 1 else "")
        logger.info("%sKV cache: %s (%s, %d bytes per token%s, %d KV heads, from %s) = %d blocks of %d tokens%s = %d "
                    "tokens, room for %d sequences of max_model_len %d%s; weights %s%s",
                    rank, _gib(cache.numel() * cache.element_size()), self._kv_dtype_description(),
                    c.kv_bytes_per_token(self.kv_dtype, self.tp_size), ", MLA latent" if c.is_mla else "",
                    self.num_kv_heads, getattr(self, "kv_budget_source", "the budget"), num_blocks, self.block_size,
                    groups, num_tokens // self.num_kv_cache_groups,
                    num_blocks // (-(-max_model_len // self.block_size) * self.num_kv_cache_groups), max_model_len,
                    "; host memory is taken lazily, as blocks are first written (set --kv-cache-memory-bytes "
                    f"or {CPU_KVCACHE_SPACE_ENV}=GiB to change)" if self.device.type == "cpu" else "",
                    _gib(self.weight_bytes()), draft)

    def kv_transfer_tensors(self) -> list[list[torch.Tensor]]:
        """Per layer, every tensor that holds its blocks (block index on dim 2): what a KV connector
        moves. One cache tensor per layer, K and V together (and, for one-byte KV, each token's scales,
        which live in the block beside its codes)."""
        return [[cache] for cache in self.kv_caches]

    def _kv_dtype_description(self) -> str:
        name = str(self.kv_dtype).removeprefix("torch.")
        if not is_quantized(self.kv_dtype):
            return name
        if self.cache_config.calculate_kv_scales:
            return f"{name} codes, per-layer scales from the first batch"
        if self.checkpoint_kv_scales is not None:
            return f"{name} codes, the checkpoint's per-layer k_scale/v_scale"
        return f"{name} codes + a bf16 scale per token and KV head"

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_cache_tensors:  # (a block's id means the same block in every tensor)
            if cache.dtype.itemsize == 1:
                raw = cache.view(torch.uint8)
                raw[:, :, dst] = raw[:, :, src]
            else:
                cache[:, :, dst] = cache[:, :, src]

    # ---- one step ----
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, in inference mode. The engine's own loops (LLM.generate's, the engine-core and worker
        processes') run in it for their whole life, and entering it runs cold Python code after each forward
        pass, so a step enters it only when its caller has not."""
        if torch.is_inference_mode_enabled():
            return self._execute(scheduler_output)
        with torch.inference_mode():
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        last, self._last_decode = self._last_decode, None
        if self.spec_decoder is not None:
            self.spec_decoder.free_requests(scheduler_output.finished_req_ids | set(scheduler_output.preempted_ids))
        # each guarded: most decode steps have none of these
        if scheduler_output.finished_req_ids:
            self.block_tables.drop(scheduler_output.finished_req_ids)
        if scheduler_output.block_table_changes:
            self.block_tables.apply(scheduler_output.block_table_changes)
        if scheduler_output.blocks_to_copy:
            self.copy_blocks(scheduler_output.blocks_to_copy)
        output = ModelRunnerOutput()
        connector_meta = scheduler_output.kv_connector_metadata
        if self.kv_connector is not None and connector_meta is not None:
            self.kv_connector.start_load_kv(connector_meta)
        if scheduler_output.scheduled:
            batch = self.prepare(scheduler_output.scheduled, last if self._continues_in_prepare else None)
            forward_start = time.perf_counter()
            hidden = self.forward(batch)
            output.forward_s = time.perf_counter() - forward_start
            self.sample(batch, hidden, output, scheduler_output.grammar_bitmask)
        if self.kv_connector is not None:
            if connector_meta is not None and connector_meta.reqs_to_save:
                for layer in range(len(self.kv_caches)):
                    self.kv_connector.save_kv_layer(layer, connector_meta)
                self.kv_connector.wait_for_save(connector_meta)
            output.kv_connector_output = self.kv_connector.get_finished(wait=not scheduler_output.scheduled)
        if self.spec_decoder is not None and scheduler_output.scheduled:
            self.spec_decoder.record_step(time.perf_counter() - start, output)
            self.spec_decoder.propose(batch.order, output)
        return output

    def execute_continued_decode(self, start_pos: list[int], num_new_tokens: list[int],
                                 block_table_changes: list[dict[str, tuple[int, list[int]]]]
                                 ) -> tuple[list[int], float] | None:
        """A steady decode step under async scheduling, from the last step's arrays (a persistent batch, as
        vLLM's InputBatch): the worker calls it for a plan that runs the last plan's requests, in its order,
        with nothing else to do (WorkerSchedulerOutput.continues_decode). When the last step was a
        plain-greedy decode of those requests and each now computes one token, one position further on,
        that token is the one the last step sampled: the step's inputs come from the last step's sampled
        tokens and block-table rows, without the per-request objects (their Python is on the critical path
        under async scheduling). Returns the sampled tokens in the plan's order and
        the forward pass's seconds (with the LM head); None, having changed nothing, where the plan does
        not continue such a step (the caller takes the general path)."""
        last = self._last_decode
        n = len(start_pos)
        # list comparisons, not numpy's: a numpy call is slow on the caches a forward pass leaves cold
        if last is None or not last.argmax or start_pos != last.next_start_pos or num_new_tokens.count(1) != n:
            return None
        self.block_tables.apply(block_table_changes)
        batch = self._continued_batch(last, None)
        forward_start = time.perf_counter()
        hidden = self.forward(batch)
        forward_s = time.perf_counter() - forward_start
        token_tensor, token_ids, lm_head_s = self._argmax_tokens(hidden)
        assert token_ids is not None  # one rank
        self._last_decode = self._decode_run(batch, token_tensor, token_ids, argmax=True)
        return token_ids, forward_s + lm_head_s

    def _argmax_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, list[int] | None, float]:
        """Each row's argmax of the LM head's logits in the matmul's dtype, as a tensor and a list (None off
        rank 0), and the seconds of the two (the model's argmax_logits: where its kernel can, the logits
        are never stored)."""
        logits_start = time.perf_counter()
        token_tensor = self.model.argmax_logits(hidden)
        lm_head_s = time.perf_counter() - logits_start
        return token_tensor, (token_tensor.tolist() if token_tensor is not None else None), lm_head_s

    def _decode_run(self, batch: Batch, token_tensor: torch.Tensor, token_ids: list[int], argmax: bool) -> _DecodeRun:
        """What the next step needs to continue this one, in which every request computed one token and
        sampled `token_ids` (see _continued_batch)."""
        tensors = self.device.type == "cpu" and token_tensor.dtype == torch.int64
        return _DecodeRun(batch.request_ids, batch.rows, [p + 1 for p in batch.start_pos], token_ids, batch.order,
                          argmax, token_tensor if tensors else None, batch.positions if tensors else None,
                          batch.rows_tensor)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)

    def prepare(self, scheduled: list[ScheduledRequest], continuing: _DecodeRun | None = None) -> Batch:
        """The step's Batch. `continuing`: the last step, a decode run (_DecodeRun); where this step runs the
        same requests in the same order, each one token on, its input ids are the tokens that step
        sampled and its rows and positions come from it too, with no per-request lists built."""
        if continuing is not None and (batch := self._continue_decode(scheduled, continuing)) is not None:
            return batch
        long = [s for s in scheduled if s.num_new_tokens > MAX_BATCHED_QUERY_LEN and not s.spec_token_ids]
        order = [s for s in scheduled if s.num_new_tokens <= MAX_BATCHED_QUERY_LEN or s.spec_token_ids] + long \
            if long else scheduled
        # One Python pass over the requests; everything else is whole-batch array work. This runs right
        # after the forward pass has flushed the CPU caches, where each small call costs several times
        # its warm price, so the step's inputs are built with as few calls as possible.
        token_ids: list[int] = []
        query_starts: list[int] = []
        start_pos: list[int] = []
        query_lens: list[int] = []
        request_ids: list[str] = []
        argmax_decode = True
        for s in order:
            start, num_new = s.start_pos, s.num_new_tokens
            end = start + num_new
            query_starts.append(len(token_ids))
            start_pos.append(start)
            query_lens.append(num_new)
            request = s.request
            request_ids.append(request.request_id)
            known = request.all_token_ids
            token_ids.extend(known[start:end])
            if end > len(known):
                token_ids.extend(s.spec_token_ids[:end - len(known)])
            argmax_decode = argmax_decode and s.sample and request.always_argmax
        argmax_decode = argmax_decode and len(token_ids) == len(order)
        if self.lora_manager is not None:
            # each token's adapter slot (a continued decode keeps the last step's: same requests, one token each)
            self.lora_manager.prepare_step([s.request.lora_request for s in order], query_lens)
        rows = self.block_tables.rows(request_ids)
        entry_start_pos, entry_query_lens, entry_rows = start_pos, query_lens, rows
        if len(token_ids) > len(order) and any(s.spec_token_ids for s in order):
            # Speculative verification: each of a request's k+1 positions is attended to as a query of its
            # own (a one-token "sequence" ending there, on the request's block table), exactly as plain
            # decoding computes that position. Attention kernels take other paths for several query rows
            # (another reduction order), and in bf16 such a last-bit difference flips near-tied argmaxes,
            # so the output would differ from plain decoding's.
            entry_start_pos, entry_query_lens, entry_rows = [], [], []
            for s, start, num_new, row in zip(order, start_pos, query_lens, rows):
                if s.spec_token_ids:
                    entry_start_pos.extend(range(start, start + num_new))
                    entry_query_lens.extend([1] * num_new)
                    entry_rows.extend([row] * num_new)
                else:
                    entry_start_pos.append(start)
                    entry_query_lens.append(num_new)
                    entry_rows.append(row)
        inputs = [step_inputs(token_ids, entry_start_pos, entry_query_lens, entry_rows, table, self.block_size,
                              zero_pad=self.backend.needs_dense_masks) for table in self.block_tables.tensors]
        return self._batch(order, len(order) - len(long), inputs, start_pos, entry_query_lens, query_starts,
                           request_ids, rows, argmax_decode, num_short_entries=len(entry_query_lens) - len(long))

    def _continue_decode(self, scheduled: list[ScheduledRequest], last: _DecodeRun) -> Batch | None:
        order = last.order
        if order is None or len(scheduled) != len(order):
            return None
        # One comparison pass (the general path's builds five lists): each request is the last step's, one
        # token further on (so its input is the token that step sampled), sampling with nothing proposed.
        for s, before, position in zip(scheduled, order, last.next_start_pos):
            if s.request is not before.request or s.start_pos != position or s.num_new_tokens != 1 \
                    or not s.sample or s.spec_token_ids:
                return None
        return self._continued_batch(last, scheduled)

    def _continued_batch(self, last: _DecodeRun, order: list[ScheduledRequest] | None) -> Batch:
        """The step that continues `last` (checked by the caller): each request one token on, its input the
        token `last` sampled, its block-table row the same."""
        n = len(last.request_ids)
        ones = [1] * n
        dense = self.backend.needs_dense_masks
        if last.token_tensor is not None:  # on the CPU: from the last step's tensors, no list read
            if last.rows_tensor is None:
                last.rows_tensor = torch.tensor(last.rows)
            inputs = [decode_step_inputs(last.token_tensor, last.positions, last.rows_tensor, table, self.block_size,
                                         zero_pad=dense) for table in self.block_tables.tensors]
        else:
            inputs = [step_inputs(last.token_ids, last.next_start_pos, ones, last.rows, table, self.block_size,
                                  zero_pad=dense) for table in self.block_tables.tensors]
        return self._batch(order, n, inputs, last.next_start_pos, ones, list(range(n)), last.request_ids,
                           last.rows, argmax_decode=last.argmax, rows_tensor=last.rows_tensor)

    def _batch(self, order: list[ScheduledRequest] | None, num_short: int, inputs: list[StepInputs],
               start_pos: list[int], query_lens: list[int], query_starts: list[int], request_ids: list[str],
               rows: list[int], argmax_decode: bool, rows_tensor: torch.Tensor | None = None,
               num_short_entries: int | None = None) -> Batch:
        """The step's Batch from its flat inputs (step_inputs, one per KV cache group: the same tokens, each
        group's block tables and slots) and lists; `order` (None: all short) gives the long prefill chunks,
        which follow the `num_short` short ones. query_lens and num_short_entries count the attention's
        sequences (`inputs`'), which split a verifying request into one per token."""
        long = order[num_short:] if order is not None else []
        if num_short_entries is None:
            num_short_entries = num_short
        groups = [self._metadata(long, num_short, num_short_entries, group_inputs, query_lens, query_starts)
                  for group_inputs in inputs]
        metadata = groups[0]
        if len(groups) > 1:
            metadata.layer_metadata = [groups[group] for group in self.group_of_layer]
        on_device = (lambda t: t) if self.device.type == "cpu" else (lambda t: t.to(self.device))
        return Batch(input_ids=on_device(inputs[0].input_ids), positions=on_device(inputs[0].positions),
                     metadata=metadata, order=order, query_starts=query_starts, request_ids=request_ids,
                     start_pos=start_pos, rows=rows, argmax_decode=argmax_decode, rows_tensor=rows_tensor)

    def _metadata(self, long: list[ScheduledRequest], num_short: int, num_short_entries: int, inputs: StepInputs,
                  query_lens: list[int], query_starts: list[int]) -> AttentionMetadata:
        """The attention metadata of one KV cache group (see _batch)."""
        bs = self.block_size
        device = self.device
        dense = self.backend.needs_dense_masks
        on_device = (lambda t: t) if device.type == "cpu" else (lambda t: t.to(device))
        metadata = AttentionMetadata(
            slot_mapping=on_device(inputs.slot_mapping), query_start_loc=on_device(inputs.query_start_loc),
            seq_lens=on_device(inputs.seq_lens), block_tables=on_device(inputs.block_tables),
            max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len)
        if long or dense:  # per-request views of the same arrays
            seq_lens, tables = inputs.seq_lens.numpy(), inputs.block_tables.numpy()
            num_blocks = (seq_lens + (bs - 1)) // bs
        if num_short and dense:
            n = num_short_entries
            self._prepare_decodes(np.array(query_lens[:n], dtype=np.int64), seq_lens[:n],
                                  tables[:n, :int(num_blocks[:n].max())], metadata)
        for i, (s, start) in enumerate(zip(long, query_starts[num_short:]), start=num_short_entries):
            seq_len = int(seq_lens[i])
            prefill = PrefillSeq(query_start=start, query_len=s.num_new_tokens, seq_len=seq_len,
                                 block_table=on_device(torch.from_numpy(tables[i, :num_blocks[i]])))
            if dense and s.start_pos > 0:
                # Bottom-right causal: query i sits at position start_pos + i. Built here once per step,
                # not in each layer.
                key_pos = torch.arange(seq_len, device=device)
                prefill.attn_mask = key_pos[None, :] <= key_pos[s.start_pos:, None]
            metadata.prefills.append(prefill)
        self.backend.prepare_metadata(metadata)
        return metadata

    def _prepare_decodes(self, query_lens: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray,
                         metadata: AttentionMetadata) -> None:
        """The padded decode batch and masks the reference (dense-mask) backend reads; takes the short
        requests' query lengths, sequence lengths and zero-padded block tables."""
        bs = self.block_size
        max_blocks = tables.shape[1]
        max_q = int(query_lens.max())
        device = self.device
        metadata.num_decodes = len(query_lens)
        metadata.num_decode_tokens = int(query_lens.sum())
        metadata.decode_max_query_len = max_q
        metadata.decode_block_tables = torch.from_numpy(np.ascontiguousarray(tables)).to(device)
        if len(query_lens) == 1 and max_q == 1:
            metadata.decode_seq_len = int(seq_lens[0])
        else:
            key_pos = np.arange(max_blocks * bs)
            query_pos = seq_lens[:, None] - query_lens[:, None] + np.arange(max_q)[None, :]   # [B, Q]
            keys = key_pos[None, None, :]
            mask = (keys <= query_pos[:, :, None]) & (keys < seq_lens[:, None, None])
            additive = np.where(mask[:, None], 0.0, -np.inf).astype(np.float32)
            metadata.decode_attn_mask = torch.from_numpy(additive).to(device=device, dtype=self.model_config.dtype)
        if max_q > 1:
            starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]])
            offsets = np.arange(max_q)[None, :]
            valid = offsets < query_lens[:, None]
            index = np.where(valid, starts[:, None] + offsets, 0)
            metadata.decode_query_index = torch.from_numpy(index).to(device)
            metadata.decode_query_valid = torch.from_numpy(valid.reshape(-1)).to(device)

    def sample(self, batch: Batch, hidden: torch.Tensor, output: ModelRunnerOutput,
               grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Sample the next token of every request that reached its last known token. Requests carrying
        speculative tokens are handed, with the logits of their k+1 positions, to `self.spec_decoder`.
        Every row that needs logits goes through the LM head in one call (one gather under TP)."""
        if batch.argmax_decode and grammar_bitmask is None:
            # The common decode step: one token per request, each taking the argmax of its raw logits and
            # asking for nothing more, so the general pass below (per-request Python) is skipped.
            token_tensor, token_ids, lm_head_s = self._argmax_tokens(hidden)
            output.forward_s += lm_head_s
            if token_ids is not None:  # rank 0
                output.sampled_token_ids.update(zip(batch.request_ids, [[token] for token in token_ids]))
                if self._keeps_decode_runs:  # the next step may continue this one (_continued_batch)
                    self._last_decode = self._decode_run(batch, token_tensor, token_ids, argmax=True)
            return
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []  # the requests of sample_rows, in order
        verify: list[tuple[ScheduledRequest, int]] = []  # (request, first row of its k+1 positions)
        verify_rows: list[int] = []
        prompt_lp: list[tuple[ScheduledRequest, int, int]] = []  # (request, first row, count)
        # Whether every sampled row just takes the argmax of its raw logits; found in this same pass,
        # which already has each request's parameters at hand.
        plain_greedy = grammar_bitmask is None
        always_argmax = True  # and whether every request always does (a continued run's fast path)
        for s, start in zip(batch.order, batch.query_starts):
            request = s.request
            params = request.sampling_params
            if params.prompt_logprobs is not None and s.start_pos < request.num_prompt_tokens - 1 \
                    and request.num_prompt_logprobs_computed < request.num_prompt_tokens:
                count = min(s.start_pos + s.num_new_tokens, request.num_prompt_tokens - 1) - s.start_pos
                prompt_lp.append((s, start, count))
            if not s.sample:
                continue
            if s.spec_token_ids:
                first = start + s.num_new_tokens - len(s.spec_token_ids) - 1
                verify.append((s, first))
                verify_rows.extend(range(first, first + len(s.spec_token_ids) + 1))
            else:
                sample_rows.append(start + s.num_new_tokens - 1)
                sampled.append(s)
                if plain_greedy and not _takes_argmax(params, request):
                    plain_greedy = False
                always_argmax = always_argmax and request.always_argmax
        prompt_rows = [row for _, start, count in prompt_lp for row in range(start, start + count)]
        logits_rows = sample_rows + verify_rows + prompt_rows
        if not logits_rows:
            return
        # A plain decode step samples from every row in order: no gather (a copy of the hidden states).
        all_rows = len(logits_rows) == hidden.shape[0] and logits_rows == list(range(len(logits_rows)))
        # Nothing but argmaxes to take: the logits stay in the matmul's dtype. In bf16 the float32 copy
        # (a fresh batch x vocab tensor every step) cost more than the argmax itself.
        argmax_only = plain_greedy and not verify_rows and not prompt_rows
        logits_start = time.perf_counter()
        all_logits = self.model.compute_logits(hidden if all_rows else hidden[logits_rows], upcast=not argmax_only)
        output.forward_s += time.perf_counter() - logits_start
        if all_logits is None:
            return  # not rank 0: the logits were gathered there, and only rank 0 samples
        num_sample, num_verify = len(sample_rows), len(verify_rows)
        if sample_rows and plain_greedy:
            # Every row takes the argmax of its raw logits and asks for nothing more: the sampler's
            # result without building its rows.
            token_tensor = argmax_rows(all_logits[:num_sample])
            token_ids = token_tensor.tolist()
            output.sampled_token_ids.update({s.request.request_id: [token] for s, token in zip(sampled, token_ids)})
        elif sample_rows:
            rows = [self.sampling_row(s.request) for s in sampled]
            logits = all_logits[:num_sample]
            max_logprobs = max((r.params.logprobs or 0) for r in rows)
            token_bitmask = None
            if grammar_bitmask is not None:
                token_bitmask = grammar_bitmask.select((s.request.request_id, i, 1) for i, s in enumerate(sampled))
            result = self.sampler(logits, rows, max_logprobs, token_bitmask)
            token_tensor = result.token_ids
            token_ids = token_tensor.tolist()
            sampled_lp = result.sampled_logprobs.tolist() if result.sampled_logprobs is not None else None
            for i, s in enumerate(sampled):
                rid = s.request.request_id
                output.sampled_token_ids[rid] = [token_ids[i]]
                num_lp = s.request.sampling_params.logprobs
                if num_lp is not None:
                    output.sampled_logprobs[rid] = [sampled_lp[i]]
                    top_ids = result.topk_token_ids[i, :num_lp].tolist() if num_lp else []
                    top_lps = result.topk_logprobs[i, :num_lp].tolist() if num_lp else []
                    output.logprobs[rid] = [position_logprobs(token_ids[i], sampled_lp[i],
                                                              int(result.sampled_ranks[i]), top_ids, top_lps)]
        if (sample_rows and self._keeps_decode_runs and len(sampled) == len(batch.order) == hidden.shape[0]
                and not prompt_lp):
            # Every request computed one token and sampled one (a decode step, sampled or under a grammar):
            # the next step may take its inputs from this one (_continue_decode).
            self._last_decode = self._decode_run(batch, token_tensor, token_ids, argmax=always_argmax)
        if verify:
            assert self.spec_decoder is not None
            self.spec_decoder.verify(verify, [self.sampling_row(s.request) for s, _ in verify],
                                     all_logits[num_sample:num_sample + num_verify], output, grammar_bitmask)
        offset = num_sample + num_verify
        for s, _, count in prompt_lp:
            output.prompt_logprobs[s.request.request_id] = self._prompt_logprobs(s, all_logits[offset:offset + count])
            offset += count

    def sampling_row(self, request: RunnerRequest) -> SamplingRow:
        params = request.sampling_params
        return SamplingRow(params, request.prompt_token_ids, request.output_token_ids,
                           list(params.all_stop_token_ids))

    def _prompt_logprobs(self, s: ScheduledRequest, logits: torch.Tensor) -> list[PositionLogprobs]:
        logprobs = logits.log_softmax(dim=-1)
        request = s.request
        targets = torch.tensor(request.prompt_token_ids[s.start_pos + 1:s.start_pos + 1 + len(logits)],
                               device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
        k = request.sampling_params.prompt_logprobs
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return [position_logprobs(target, lp, rank, ids, lps) for target, lp, rank, ids, lps in
                zip(targets.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())]


def _takes_argmax(params: SamplingParams, request: RunnerRequest) -> bool:
    """Greedy with no logprobs, penalties or min_tokens still holding back a stop token: the sampler would
    return the argmax of the raw logits."""
    return (params.greedy and params.logprobs is None and not params.has_penalties
            and (not params.min_tokens or len(request.output_token_ids) >= params.min_tokens))
