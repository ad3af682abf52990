"""The draft-model proposer: a small model with its own paged KV cache proposes k tokens per request.

The draft has its own runner (a DraftRunner, made by the target's worker) and its own block pool,
managed by the same KVCacheManager logic as the target's (block tables, slots, trim). Each engine step
it runs, batched over every request that proposes:

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

import torch

from pagedllm.core_types.scheduler_output import ScheduledRequest
from pagedllm.kv_cache.hashing import BlockHash
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.layers.sampler import SamplingRow, adjusted_logits, argmax_rows, exponential_noise, holds_back_stops
from pagedllm.spec_decode.proposer import DraftRequest, DraftRunner
from pagedllm.spec_decode.rejection_sampler import request_probs, row_with_drafts


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
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks; cut back on rollback

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    def __init__(self, runner: DraftRunner):
        # The draft's runner, made by the target's worker (spec_decode/ does not import the worker).
        self.runner = runner
        self.kv: KVCacheManager | None = None
        self.seqs: dict[str, DraftSeq] = {}

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV pool; the target's runner sizes it, inside the same memory budget."""
        self.runner.cache_config.num_blocks = num_blocks
        self.runner.allocate_kv_cache(num_blocks)
        # Prefix caching as in the target's pool: requests sharing a prompt prefix share its draft KV too,
        # else a shared-prefix workload that fits the target's pool overflows the draft's and stops proposals.
        self.kv = KVCacheManager(num_blocks, self.runner.block_size,
                                 enable_caching=self.runner.cache_config.enable_prefix_caching)

    def free(self, request_ids: set[str]) -> None:
        """Give back the draft blocks of requests that left the running set."""
        for request_id in request_ids:
            if self.seqs.pop(request_id, None) is not None:
                self.kv.free(request_id)
        self.runner.block_tables.drop(request_ids)

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
        del seq.block_hashes[matched // self.runner.block_size:]  # blocks that held rolled-back drafts
        seq.all_token_ids.extend(tokens[matched:])
        seq.num_confirmed = len(tokens)
        return seq

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], num_spec_tokens: list[int], base_rows: list[SamplingRow],
                prefill: list[DraftRequest] | None = None, max_catch_up_tokens: int | None = None
                ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Up to num_spec_tokens[i] draft tokens for requests[i], with the distributions they were drawn
        from ([k, V]; None for greedy requests, whose verification needs only the tokens).

        prefill: requests whose prompt chunk the target computed this step without sampling; the draft
        computes the same chunk now, so a request's draft prefill is spread over the steps the target's is.
        max_catch_up_tokens: the most tokens the catch-up pass may compute (the step's token budget); a
        request whose catch-up does not fit (a prefix the target had cached and the draft had not) catches
        up in part and proposes nothing this step."""
        prefill = prefill or []
        requests = requests + prefill
        num_spec_tokens = num_spec_tokens + [0] * len(prefill)
        seqs = [self._sync(request) for request in requests]
        # Greedy with nothing to adjust (no penalties, min_tokens met: drafts only lengthen the output), so
        # a draft token is the argmax of the raw logits, taken in the matmul's dtype (the same index: the
        # cast to float32 is exact), without building each pass's rows or the adjusted logits.
        plain = [row.params.greedy and not row.params.has_penalties and not holds_back_stops(row)
                 for row in base_rows] + [False] * len(prefill)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_spec_tokens) if k > 0]
        feeding = active + [i for i, k in enumerate(num_spec_tokens) if k == 0]  # the catch-up pass
        allowance = max_catch_up_tokens
        while feeding:
            scheduled, stepping = [], []
            for i in feeding:
                seq = seqs[i]
                cached_blocks, num_cached = [], 0
                if seq.num_computed_tokens == 0 and not self.kv.get_block_ids(seq.request_id):
                    # a new request: its prompt prefix may be in the draft's cache (the last token never is)
                    cached_blocks, num_cached = self.kv.get_computed_blocks(seq, seq.num_tokens - 1)
                num_new = seq.num_tokens - seq.num_computed_tokens - num_cached
                assert num_new >= 1
                if allowance is not None:
                    num_new = min(num_new, allowance)
                    if num_new <= 0:
                        continue
                # only blocks full of the request's own tokens enter the cache, never draft tokens
                if not self.kv.allocate_slots(seq, num_new, cached_blocks, num_cacheable_tokens=seq.num_confirmed):
                    continue  # the draft pool is full: this request proposes what it has so far
                if allowance is not None:
                    allowance -= num_new
                if cached_blocks:
                    self.kv.record_prefix_query(seq.num_tokens, num_cached)
                seq.num_computed_tokens += num_cached
                reaches_end = seq.num_computed_tokens + num_new == seq.num_tokens
                scheduled.append(ScheduledRequest(
                    request=seq, num_new_tokens=num_new, start_pos=seq.num_computed_tokens,  # type: ignore[arg-type]
                    block_ids=[], sample=reaches_end))  # the runner's tables come from take_table_changes
                if reaches_end and num_spec_tokens[i] > 0:
                    stepping.append(i)
            allowance = None  # the k-1 passes after the catch-up feed one token per proposing request
            if not scheduled:
                break
            # a shared partial block is copied before it is written (re-feeding a request's last token)
            self.runner.copy_blocks(self.kv.take_pending_copies())
            self.runner.block_tables.apply(self.kv.take_table_changes())
            batch = self.runner.prepare(scheduled)
            hidden = self.runner.forward(batch)
            for s in scheduled:
                s.request.num_computed_tokens += s.num_new_tokens
            feeding = []
            if not stepping:
                break
            last_row = {id(s.request): start + s.num_new_tokens - 1
                        for s, start in zip(batch.order, batch.query_starts)}
            sample_rows = [last_row[id(seqs[i])] for i in stepping]
            # the single-token passes sample every row, in order: no gather
            last_hidden = hidden if sample_rows == list(range(hidden.shape[0])) else hidden[sample_rows]
            rows: list[SamplingRow] = []
            q = None
            if all(plain[i] for i in stepping):
                token_ids = self.runner.model.argmax_logits(last_hidden).tolist()
            else:
                logits = self.runner.model.compute_logits(last_hidden)
                rows = [row_with_drafts(base_rows[i], drafts[i]) for i in stepping]
                if all(row.params.greedy for row in rows):  # skip the distribution entirely
                    token_ids = argmax_rows(adjusted_logits(logits, rows)).tolist()
                else:
                    q = request_probs(logits, rows)
                    token_ids = self._sample(q, rows)
            for j, i in enumerate(stepping):
                request, seq = requests[i], seqs[i]
                drafts[i].append(token_ids[j])
                if q is not None and not rows[j].params.greedy and not rows[j].seeded:
                    probs[i].append(q[j])  # a seeded request's drafts are verified without q
                seq.all_token_ids.append(token_ids[j])  # fed to the next pass, or rolled back later
                params = request.sampling_params
                # a token that would end the request (EOS only without ignore_eos): nothing follows it
                stop = token_ids[j] in params.all_stop_token_ids and (
                    not params.ignore_eos or token_ids[j] in params.stop_token_ids)
                if len(drafts[i]) < num_spec_tokens[i] and not stop:
                    feeding.append(i)
        proposals: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        for request, tokens, q_rows in zip(requests, drafts, probs):
            if tokens:
                proposals[request.request_id] = (tokens, torch.stack(q_rows) if q_rows else None)
        return proposals

    def _sample(self, q: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Draw each draft token from q (greedy rows: q is one-hot). A seeded request's draft at position j
        uses the noise the target's sample at j will use (exponential_noise), coupling the two draws."""
        token_ids = argmax_rows(q)
        random = [j for j, row in enumerate(rows) if not row.params.greedy]
        if random:
            sub_rows = [rows[j] for j in random]
            noise = exponential_noise((len(random), q.shape[1]), sub_rows, q.device, self.runner.sampler.generator)
            token_ids[random] = argmax_rows(q[random] / noise)
        return token_ids.tolist()
