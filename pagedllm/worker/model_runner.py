"""The model runner: applies a step's plan (WorkerSchedulerOutput, deltas) to its InputBatch, turns it
into tensors, runs one forward pass, samples.

It owns the model, the paged KV cache tensors, the attention backend and the worker's copies of the
requests (worker/input_batch.py), and knows nothing of policy.
Under tensor parallelism every rank runs one, on its shard of the weights and KV heads, with the same
inputs; the logits are gathered on rank 0, which alone samples.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm import envs, forward_context
from pagedllm.attention.backend import AttentionMetadata, PrefillSeq
from pagedllm.attention.selector import get_attn_backend
from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import (
    RunnerRequest,
    ScheduledRequest,
    ScheduledRequestsData,
    WorkerSchedulerOutput,
)
from pagedllm.distributed.parallel_state import broadcast_object, broadcast_tensor
from pagedllm.forward_context import RowSplit
from pagedllm.kv_cache.quant import KV_CACHE_DTYPES, is_quantized, resolve_kv_cache_dtype  # noqa: F401
from pagedllm.layers.quantization.vnni import routes_prompt_rows
from pagedllm.layers.sampler import Sampler, SamplingRow, argmax_rows, logprob_stats
from pagedllm.models.loader import load_model
from pagedllm.outputs import PositionLogprobs, position_logprobs
from pagedllm.platform import zero_page_buffer
from pagedllm.spec_decode.spec_decoder import SpecDecoder
from pagedllm.structured_output import GrammarBitmask
from pagedllm.worker.block_table import BlockTables
from pagedllm.worker.input_batch import InputBatch
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
    query_starts: Sequence[int]    # each request's first token in the flat batch
    rows: list[int]                # each request's row of the runner's InputBatch (and BlockTables)
    # The scheduled requests in batch order; a decode step makes them only when something reads them
    # (its inputs and a greedy step's sampling need none), from `make_order`.
    _order: list[ScheduledRequest] | None = None
    make_order: Callable[[], list[ScheduledRequest]] | None = None
    # A decode step: every request computes its last known token and samples the next one, so row i of
    # the hidden states is request i's only row and nothing but sampling is asked of it.
    decode: bool = False
    # A decode step's sampled tokens, row i's for request i (set by sample() on the rank that samples)
    sampled_tokens: torch.Tensor | None = None
    # The rows at prompt positions, where the model's layers ask (ModelRunner.routes_prompt_rows)
    prompt_rows: RowSplit | None = None

    @property
    def order(self) -> list[ScheduledRequest]:
        if self._order is None:
            assert self.make_order is not None
            self._order = self.make_order()
        return self._order


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
        self.on_cpu = device.type == "cpu"  # (read every step: torch.device's attributes cost more)
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
        # whether each step names its prompt rows for the forward pass (forward_context); a draft model's
        # outputs only propose, so its rows need not follow one rule
        self.routes_prompt_rows = batch_invariant and routes_prompt_rows(self.model, model_config.dtype)
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
        # Every live request's state, tokens, sampling flags and block-table rows, kept from each step's
        # deltas (the block tables from the KV cache manager's changes, which the plan carries); a draft
        # model's runner shares the target's block tables
        self.input_batch = InputBatch(scheduler_config.max_num_seqs, scheduler_config.max_model_len,
                                      -(-scheduler_config.max_model_len // self.block_size) + 1,
                                      num_groups=self.num_kv_cache_groups, block_tables=block_tables)
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

    @property
    def block_tables(self) -> BlockTables:
        return self.input_batch.block_tables

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
            # zero pages on first touch: start-up does not write (and the process does not hold) gigabytes
            # of cache that no request has used yet
            cache = zero_page_buffer(math.prod(shape) * storage_dtype.itemsize).view(storage_dtype).view(shape)
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

    # ---- one step ----
    def execute(self, message: WorkerSchedulerOutput) -> ModelRunnerOutput:
        """One step, in inference mode. The engine's own loops (LLM.generate's, the engine-core and worker
        processes') run in it for their whole life, and entering it runs cold Python code after each forward
        pass, so a step enters it only when its caller has not."""
        if torch.is_inference_mode_enabled():
            return self._execute(message)
        with torch.inference_mode():
            return self._execute(message)

    def _execute(self, message: WorkerSchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        # each guarded: most decode steps have none of these
        if self.spec_decoder is not None and (message.finished_req_ids or message.preempted_ids):
            self.spec_decoder.free_requests(message.finished_req_ids | set(message.preempted_ids))
        self.input_batch.update(message)
        columns = message.scheduled
        runs = bool(columns.num_new_tokens)
        output = ModelRunnerOutput()
        connector_meta = message.kv_connector_metadata
        if self.kv_connector is not None and connector_meta is not None:
            self.kv_connector.start_load_kv(connector_meta)
        if runs:
            batch = self._prepare_plan(columns)
            forward_start = time.perf_counter()
            output.prepare_s = forward_start - start
            hidden = self.forward(batch)
            sample_start = time.perf_counter()
            output.forward_s = model_s = sample_start - forward_start
            self.sample(batch, hidden, output, message.grammar_bitmask)  # adds the LM head's time to forward_s
            self._keep_sampled(batch, output)
            lm_head_s = output.forward_s - model_s
            output.sample_s = time.perf_counter() - sample_start - lm_head_s
        if self.kv_connector is not None:
            if connector_meta is not None and connector_meta.reqs_to_save:
                for layer in range(len(self.kv_caches)):
                    self.kv_connector.save_kv_layer(layer, connector_meta)
                self.kv_connector.wait_for_save(connector_meta)
            output.kv_connector_output = self.kv_connector.get_finished(wait=not runs)
        if self.spec_decoder is not None and runs:
            self.spec_decoder.record_step(time.perf_counter() - start, output)
            self.spec_decoder.propose(batch.order, output, {
                request_id: tokens for request_id, tokens in zip(self.input_batch.request_ids, output.sampled_token_ids)
                if tokens})
        return output

    def _keep_sampled(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """Append the step's sampled tokens to the input batch's rows, on every rank (rank 0 alone samples,
        and sends them to the others), before anything reads them (the proposer drafts past them). A
        decode step's are held as a tensor, for the next step's input gather to append (InputBatch)."""
        if batch.decode:
            tokens = batch.sampled_tokens  # int64 (every argmax and the sampler give it); None off rank 0
            if tokens is not None and not self.on_cpu:
                tokens = tokens.cpu()  # (only where needed: right after the forward pass, a call costs microseconds)
            if self.tp_size > 1:
                tokens = broadcast_tensor(tokens if tokens is not None
                                          else torch.empty(len(batch.rows), dtype=torch.long))
            if tokens is not None:
                self.input_batch.hold_sampled(tokens)
            return
        sampled = output.sampled_token_ids
        if self.tp_size > 1:
            sampled = broadcast_object(sampled if self.tp_rank == 0 else None)
        if sampled:
            self.input_batch.append_sampled(sampled)

    def forward(self, batch: Batch) -> torch.Tensor:
        if batch.prompt_rows is None:
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)
        with forward_context.use(batch.prompt_rows):
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)

    def _prepare_plan(self, columns: ScheduledRequestsData) -> Batch:
        """The step's Batch from the input batch, just updated with the plan whose columns these are (in the
        order of the batch's last rows). A decode step (each request computes one token and samples) takes
        its inputs from the batch's arrays in one call, with no per-request Python; any other goes
        through prepare."""
        input_batch = self.input_batch
        n = len(columns.num_new_tokens)
        if columns.sample is not None or columns.spec_token_ids is not None or sum(columns.num_new_tokens) != n:
            input_batch.flush_sampled()
            return self.prepare(input_batch.plan(columns), input_batch.rows)
        ones = [1] * n
        if self.lora_manager is not None:
            self.lora_manager.prepare_step([state.lora_request for state in input_batch.states], ones)
        # the last decode step's sampled tokens (held by the input batch) are appended by the first call
        held = input_batch.take_held_tokens()
        inputs = []
        for table in self.block_tables.tensors:
            inputs.append(decode_step_inputs(input_batch.token_tensor, input_batch.num_tokens_tensor,
                                             input_batch.rows_tensor, table, self.block_size,
                                             self.backend.needs_dense_masks, held))
            held = None
        batch = self._batch(None, n, inputs, ones, range(n), input_batch.rows)
        batch.make_order = partial(input_batch.plan, columns)
        batch.decode = True
        return batch

    def prepare(self, scheduled: list[ScheduledRequest], rows: list[int] | None = None) -> Batch:
        """The step's Batch from the scheduled requests' token lists. `rows`: the requests' rows of the block
        tables, in `scheduled`'s order (looked up by request id where not given)."""
        long = [i for i, s in enumerate(scheduled) if s.num_new_tokens > MAX_BATCHED_QUERY_LEN and not s.spec_token_ids]
        if rows is None:
            rows = self.block_tables.rows([s.request.request_id for s in scheduled])
        if long:
            long_set = set(long)
            short = [i for i in range(len(scheduled)) if i not in long_set]
            order = [scheduled[i] for i in short] + [scheduled[i] for i in long]
            rows = [rows[i] for i in short] + [rows[i] for i in long]
        else:
            order = scheduled
        # One Python pass over the requests; everything else is whole-batch array work. This runs right
        # after the forward pass has flushed the CPU caches, where each small call costs several times
        # its warm price, so the step's inputs are built with as few calls as possible.
        token_ids: list[int] = []
        query_starts: list[int] = []
        start_pos: list[int] = []
        query_lens: list[int] = []
        for s in order:
            start, num_new = s.start_pos, s.num_new_tokens
            end = start + num_new
            query_starts.append(len(token_ids))
            start_pos.append(start)
            query_lens.append(num_new)
            # (a slice of the known tokens: a long request's whole list is not copied for each chunk)
            known = s.request.token_slice(start, end)
            token_ids.extend(known)
            if len(known) < num_new:
                token_ids.extend(s.spec_token_ids[:num_new - len(known)])
        if self.lora_manager is not None:
            self.lora_manager.prepare_step([s.request.lora_request for s in order], query_lens)
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
        return self._batch(order, len(order) - len(long), inputs, entry_query_lens, query_starts, rows,
                           num_short_entries=len(entry_query_lens) - len(long))

    def _batch(self, order: list[ScheduledRequest] | None, num_short: int, inputs: list[StepInputs],
               query_lens: list[int], query_starts: Sequence[int], rows: list[int],
               num_short_entries: int | None = None) -> Batch:
        """The step's Batch from its flat inputs (step_inputs, one per KV cache group: the same tokens, each
        group's block tables and slots) and lists; the long prefill chunks of `order` follow its `num_short`
        short ones (`order` None: a decode step's, all short). query_lens and num_short_entries count the
        attention's sequences (`inputs`'), which split a verifying request into one per token."""
        long = order[num_short:] if order is not None else []
        if num_short_entries is None:
            num_short_entries = num_short
        groups = [self._metadata(long, num_short, num_short_entries, group_inputs, query_lens, query_starts)
                  for group_inputs in inputs]
        metadata = groups[0]
        if len(groups) > 1:
            metadata.layer_metadata = [groups[group] for group in self.group_of_layer]
        on_device = (lambda t: t) if self.on_cpu else (lambda t: t.to(self.device))
        return Batch(input_ids=on_device(inputs[0].input_ids), positions=on_device(inputs[0].positions),
                     metadata=metadata, query_starts=query_starts, rows=rows, _order=order,
                     prompt_rows=self._prompt_rows(order, query_starts, len(inputs[0].input_ids))
                     if self.routes_prompt_rows else None)

    def _prompt_rows(self, order: list[ScheduledRequest] | None, query_starts: Sequence[int],
                     num_rows: int) -> RowSplit | None:
        """The flat batch's rows at positions before their request's prompt ends. A decode step's request
        computes its last known token: a prompt row while it has no output token yet (its prompt was
        cached but for that token)."""
        input_batch = self.input_batch
        if order is None:
            rows = input_batch.rows_array
            at_prompt = input_batch.num_tokens[rows] <= input_batch.num_prompt_tokens[rows]
            if not at_prompt.any():
                return None
            return RowSplit.from_runs(num_rows, [(i, i + 1) for i in np.flatnonzero(at_prompt).tolist()])
        return RowSplit.from_runs(num_rows, [
            (start, start + max(0, min(s.num_new_tokens, s.request.num_prompt_tokens - s.start_pos)))
            for s, start in zip(order, query_starts)])

    def _metadata(self, long: list[ScheduledRequest], num_short: int, num_short_entries: int, inputs: StepInputs,
                  query_lens: list[int], query_starts: Sequence[int]) -> AttentionMetadata:
        """The attention metadata of one KV cache group (see _batch)."""
        bs = self.block_size
        device = self.device
        dense = self.backend.needs_dense_masks
        on_device = (lambda t: t) if self.on_cpu else (lambda t: t.to(device))
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
        verify: list[tuple[ScheduledRequest, int]] = []  # (request, first row of its k+1 positions)
        verify_rows: list[int] = []
        prompt_lp: list[tuple[ScheduledRequest, int, int]] = []  # (request, first row, count)
        sampled: list[ScheduledRequest] | None
        if batch.decode:  # row i samples for request i, and nothing else is asked (the requests: batch.order)
            sampled, sample_rows, sampled_batch_rows = None, list(range(len(batch.rows))), batch.rows
        else:
            sample_rows, sampled, sampled_batch_rows = self._sample_rows(batch, verify, verify_rows, prompt_lp)
        prompt_rows = [row for _, start, count in prompt_lp for row in range(start, start + count)]
        logits_rows = sample_rows + verify_rows + prompt_rows
        if not logits_rows:
            return
        # A plain decode step samples from every row in order: no gather (a copy of the hidden states).
        all_rows = batch.decode or (len(logits_rows) == hidden.shape[0]
                                    and logits_rows == list(range(len(logits_rows))))
        # Rows that take the argmax of their raw logits (InputBatch.greedy) need no sampler rows built.
        all_greedy = grammar_bitmask is None and (
            self.input_batch.plan_greedy if batch.decode else self.input_batch.all_greedy(sampled_batch_rows))
        logits_start = time.perf_counter()
        if all_greedy and not verify_rows and not prompt_rows:
            # Nothing but argmaxes: the model's fused argmax over the LM head (the logits stay in the
            # matmul's dtype, and where its kernel can they are never stored).
            token_tensor = self.model.argmax_logits(hidden if all_rows else hidden[sample_rows])
            output.forward_s += time.perf_counter() - logits_start
            if token_tensor is not None:  # rank 0
                batch.sampled_tokens = token_tensor
                output.sampled_token_ids = self._in_plan_order(sampled, token_tensor.tolist())
            return
        all_logits = self.model.compute_logits(hidden if all_rows else hidden[logits_rows])
        output.forward_s += time.perf_counter() - logits_start
        if all_logits is None:
            return  # not rank 0: the logits were gathered there, and only rank 0 samples
        num_sample, num_verify = len(sample_rows), len(verify_rows)
        if sampled is None:
            sampled = batch.order
        token_ids: list[int] = []
        if sample_rows and all_greedy:
            batch.sampled_tokens = argmax_rows(all_logits[:num_sample])
            token_ids = batch.sampled_tokens.tolist()
        elif sample_rows:
            rows = [self.sampling_row(s.request) for s in sampled]
            logits = all_logits[:num_sample]
            max_logprobs = max((r.params.logprobs or 0) for r in rows)
            token_bitmask = None
            if grammar_bitmask is not None:
                token_bitmask = grammar_bitmask.select((s.request.request_id, i, 1) for i, s in enumerate(sampled))
            params = self.input_batch.filter_params(sampled_batch_rows, logits.dtype, logits.device, logits.shape[-1])
            result = self.sampler(logits, rows, max_logprobs, token_bitmask, params)
            batch.sampled_tokens = result.token_ids
            token_ids = result.token_ids.tolist()
            sampled_lp = result.sampled_logprobs.tolist() if result.sampled_logprobs is not None else None
            for i, s in enumerate(sampled):
                num_lp = s.request.sampling_params.logprobs
                if num_lp is not None:
                    rid = s.request.request_id
                    output.sampled_logprobs[rid] = [sampled_lp[i]]
                    top_ids = result.topk_token_ids[i, :num_lp].tolist() if num_lp else []
                    top_lps = result.topk_logprobs[i, :num_lp].tolist() if num_lp else []
                    output.logprobs[rid] = [position_logprobs(token_ids[i], sampled_lp[i],
                                                              int(result.sampled_ranks[i]), top_ids, top_lps)]
        verified = None
        if verify:
            assert self.spec_decoder is not None
            verified = self.spec_decoder.verify(verify, [self.sampling_row(s.request) for s, _ in verify],
                                                all_logits[num_sample:num_sample + num_verify], output,
                                                grammar_bitmask)
        output.sampled_token_ids = self._in_plan_order(None if batch.decode else sampled, token_ids, verified)
        offset = num_sample + num_verify
        for s, _, count in prompt_lp:
            output.prompt_logprobs[s.request.request_id] = self._prompt_logprobs(s, all_logits[offset:offset + count])
            offset += count

    def _in_plan_order(self, sampled: list[ScheduledRequest] | None, token_ids: list[int],
                       verified: dict[str, list[int]] | None = None) -> list[list[int]]:
        """Each of the plan's requests' sampled tokens, in the plan's order (ModelRunnerOutput's): token_ids[i]
        for sampled[i] (for request i where sampled is None: a decode step, every request sampling), the
        tokens of requests that verified proposals, none for the others."""
        if sampled is None:
            return [[token] for token in token_ids]
        by_id = {s.request.request_id: [token] for s, token in zip(sampled, token_ids)}
        if verified:
            by_id.update(verified)
        return [by_id.get(request_id, []) for request_id in self.input_batch.request_ids]

    @staticmethod
    def _sample_rows(batch: Batch, verify: list[tuple[ScheduledRequest, int]], verify_rows: list[int],
                     prompt_lp: list[tuple[ScheduledRequest, int, int]]
                     ) -> tuple[list[int], list[ScheduledRequest], list[int]]:
        """The rows of the hidden states that sample (and their requests and input-batch rows, in order);
        fills `verify` and `verify_rows` with the requests that verify proposals and their rows, and
        `prompt_lp` with those that want prompt logprobs."""
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        sampled_batch_rows: list[int] = []
        for s, start, row in zip(batch.order, batch.query_starts, batch.rows):
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
                sampled_batch_rows.append(row)
        return sample_rows, sampled, sampled_batch_rows

    def sampling_row(self, request: RunnerRequest) -> SamplingRow:
        params = request.sampling_params
        return SamplingRow(params, request.prompt_token_ids, request.output_token_ids,
                           list(params.all_stop_token_ids))

    def _prompt_logprobs(self, s: ScheduledRequest, logits: torch.Tensor) -> list[PositionLogprobs]:
        request = s.request
        targets = torch.tensor(request.prompt_token_ids[s.start_pos + 1:s.start_pos + 1 + len(logits)],
                               device=logits.device)
        chosen, top_lp, top_ids, ranks = logprob_stats(logits.contiguous(), targets,
                                                       request.sampling_params.prompt_logprobs or 0)
        return [position_logprobs(target, lp, rank, ids, lps) for target, lp, rank, ids, lps in
                zip(targets.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())]

