"""The draft-model proposer: a small model with its own paged KV cache proposes k tokens per request.

The draft has its own ModelRunner and its own block pool, managed by the same KVCacheManager logic as the
target's (block tables, slots, trim). Each engine step it runs, batched over every request that proposes:

  1. a catch-up pass: the tokens the draft has not seen yet (the whole prompt for a new request; after a
     verification, the accepted drafts it had not fed plus the target's correction or bonus token),
     whose last position gives q_1 and the first draft token;
  2. k-1 single-token passes, each feeding the previous draft token and sampling the next.

Draft KV for tokens the target rejected is rolled back before the next proposal: the draft keeps the
tokens it has KV for, and the longest prefix that still matches the request's tokens survives (blocks
past it are freed, slots beyond it are overwritten). A request that leaves the running set (finished,
aborted, preempted) frees all of its draft blocks.

It runs unsharded (TP 1) inside rank 0's model runner: its layers never communicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.scheduler import ScheduledRequest
from pagedllm.kv_cache.hashing import BlockHash
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.layers.sampler import SamplingRow, adjusted_logits, exponential_noise
from pagedllm.spec_decode.rejection_sampler import request_probs, row_with_drafts
from pagedllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedllm.spec_decode.spec_decoder import DraftRequest


@dataclass(eq=False)
class DraftSeq:
    """One request as the draft's KV cache manager and runner see it (a CacheableRequest).

    all_token_ids: the request's tokens followed by this step's drafts. The first num_computed_tokens of
    them have KV in the draft's pool; the first num_confirmed are known to equal the request's tokens.
    """

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_confirmed: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)  # unused: the draft pool does no caching

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    def __init__(self, model_config: ModelConfig, block_size: int, scheduler_config: SchedulerConfig,
                 device: torch.device, seed: int):
        cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model_config, cache_config, scheduler_config, device, seed=seed)
        self.kv: KVCacheManager | None = None
        self.seqs: dict[str, DraftSeq] = {}

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV pool; the target's runner sizes it, inside the same memory budget."""
        self.runner.cache_config.num_blocks = num_blocks
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, self.runner.block_size, enable_caching=False)

    def free(self, request_ids: set[str]) -> None:
        """Give back the draft blocks of requests that left the running set."""
        for request_id in request_ids:
            if self.seqs.pop(request_id, None) is not None:
                self.kv.free(request_id)

    def _sync(self, request: DraftRequest) -> DraftSeq:
        """Roll the draft's KV back to the longest prefix it shares with the request's tokens."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            seq = self.seqs[request.request_id] = DraftSeq(request.request_id)
        tokens = request.all_token_ids
        # The last token is always fed again: its logits give the first draft token. The draft may already
        # hold KV for it (its earlier proposals were dropped unverified and the target then sampled the
        # same token), and without this cap the catch-up would have nothing to compute. The draft pool may
        # also have refused a catch-up, leaving num_confirmed above what has KV.
        limit = min(seq.num_computed_tokens, len(tokens) - 1)
        matched = min(seq.num_confirmed, limit)
        while matched < limit and seq.all_token_ids[matched] == tokens[matched]:
            matched += 1
        seq.num_computed_tokens = matched
        self.kv.trim(seq)
        del seq.all_token_ids[matched:]
        seq.all_token_ids.extend(tokens[matched:])
        seq.num_confirmed = len(tokens)
        return seq

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], num_spec_tokens: list[int], base_rows: list[SamplingRow]
                ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Up to num_spec_tokens[i] draft tokens for requests[i], with the distributions they were drawn
        from ([k, V]; None for greedy requests, whose verification needs only the tokens)."""
        seqs = [self._sync(request) for request in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_spec_tokens) if k > 0]
        while active:
            scheduled, stepping = [], []
            for i in active:
                seq = seqs[i]
                num_new = seq.num_tokens - seq.num_computed_tokens
                assert num_new >= 1
                if not self.kv.allocate_slots(seq, num_new):
                    continue  # the draft pool is full: this request proposes what it has so far
                scheduled.append(ScheduledRequest(
                    request=seq, num_new_tokens=num_new, start_pos=seq.num_computed_tokens,  # type: ignore[arg-type]
                    block_ids=self.kv.get_block_ids(seq.request_id), sample=True))
                stepping.append(i)
            if not scheduled:
                break
            batch = self.runner.prepare(scheduled)
            hidden = self.runner.forward(batch)
            last_row = {id(s.request): start + s.num_new_tokens - 1
                        for s, start in zip(batch.order, batch.query_starts)}
            logits = self.runner.model.compute_logits(hidden[[last_row[id(seqs[i])] for i in stepping]])
            rows = [row_with_drafts(base_rows[i], drafts[i]) for i in stepping]
            if all(row.params.greedy for row in rows):  # the common case: skip the distribution entirely
                q = None
                token_ids = adjusted_logits(logits, rows).argmax(dim=-1).tolist()
            else:
                q = request_probs(logits, rows)
                token_ids = self._sample(q, rows)
            active = []
            for j, i in enumerate(stepping):
                request, seq = requests[i], seqs[i]
                seq.num_computed_tokens = seq.num_tokens
                drafts[i].append(token_ids[j])
                if q is not None and not rows[j].params.greedy and rows[j].generator is None:
                    probs[i].append(q[j])  # a seeded request's drafts are verified without q
                seq.all_token_ids.append(token_ids[j])  # fed to the next pass, or rolled back later
                params = request.sampling_params
                # a token that would end the request (EOS only without ignore_eos): nothing follows it
                stop = token_ids[j] in params.all_stop_token_ids and (
                    not params.ignore_eos or token_ids[j] in params.stop_token_ids)
                if len(drafts[i]) < num_spec_tokens[i] and not stop:
                    active.append(i)
        proposals: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        for request, tokens, q_rows in zip(requests, drafts, probs):
            if tokens:
                proposals[request.request_id] = (tokens, torch.stack(q_rows) if q_rows else None)
        return proposals

    def _sample(self, q: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Draw each draft token from q (greedy rows: q is one-hot). A seeded request's draft at position j
        uses the noise the target's sample at j will use (exponential_noise), coupling the two draws."""
        token_ids = q.argmax(dim=-1)
        random = [j for j, row in enumerate(rows) if not row.params.greedy]
        if random:
            sub_rows = [rows[j] for j in random]
            noise = exponential_noise((len(random), q.shape[1]), sub_rows, q.device, self.runner.sampler.generator)
            token_ids[random] = (q[random] / noise).argmax(dim=-1)
        return token_ids.tolist()
