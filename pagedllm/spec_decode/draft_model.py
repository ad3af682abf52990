"""The draft-model proposer: a small model whose KV lives in the target's blocks proposes k tokens per request.

The draft has its own runner (a DraftRunner, made by the target's worker) and its own cache tensors, one
block for each of the target's blocks: the one KV cache manager allocates a request's blocks for target
and draft together, with num_lookahead_tokens slots past its scheduled tokens for the draft's positions,
and frees them with the request, so the draft reads the target's block tables and owns no blocks. Each
engine step it runs, batched over every scheduled request:

  1. a catch-up pass: the tokens the draft has not seen yet (the prompt chunk the target computed this
     step; after a verification, the accepted drafts it had not fed plus the target's correction or
     bonus token), whose last position gives q_1 and the first draft token;
  2. k-1 single-token passes, each feeding the previous draft token and sampling the next.

The draft's KV of tokens the target rejected is rolled back before the next proposal: the draft keeps
the longest prefix of what it computed that still matches the request's tokens and lies in blocks the
request held since (the manager gives back the blocks past a request's computed tokens after a
rejection); it computes the rest again. A request the draft first sees starts where the target's step
starts: a prefix-cache hit holds the draft's KV too, as the draft computed every token the target did.

It runs unsharded (TP 1) inside rank 0's model runner: its layers never communicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.core_types.scheduler_output import ScheduledRequest
from pagedllm.layers.sampler import SamplingRow, adjusted_logits, argmax_rows, exponential_noise, holds_back_stops
from pagedllm.spec_decode.proposer import DraftRequest, DraftRunner, ProposeInput
from pagedllm.spec_decode.rejection_sampler import request_probs, row_with_drafts


@dataclass(eq=False)
class DraftSeq:
    """One request as the draft's runner sees it.

    all_token_ids: the request's tokens followed by this step's drafts. The first num_computed_tokens of
    them have the draft's KV in the request's blocks; the first num_confirmed are known to equal the
    request's tokens.
    """

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_confirmed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


class DraftModelProposer:
    model_free = False
    samples_drafts = True

    def __init__(self, runner: DraftRunner):
        # The draft's runner, made by the target's worker (spec_decode/ does not import the worker).
        self.runner = runner
        self.block_size = runner.block_size
        self.seqs: dict[str, DraftSeq] = {}

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's pool: block i of the draft's tensors belongs to whoever holds block i."""
        self.runner.cache_config.num_blocks = num_blocks
        self.runner.allocate_kv_cache(num_blocks)

    def cost_per_token(self, target_num_layers: int, target_weight_bytes: int) -> float:
        """A small model's step is part per-operator overhead (in proportion to layers: at these sizes
        microseconds per torch call dominate) and part weight reads (in proportion to bytes): the geometric
        mean of the two ratios."""
        layer_ratio = self.runner.model_config.num_hidden_layers / target_num_layers
        byte_ratio = self.runner.weight_bytes() / target_weight_bytes
        return (layer_ratio * byte_ratio) ** 0.5

    def free(self, request_ids: set[str]) -> None:
        """Forget requests that left the running set (their blocks go back with the target's)."""
        for request_id in request_ids:
            self.seqs.pop(request_id, None)

    def _sync(self, request: DraftRequest) -> DraftSeq:
        """Roll the draft's KV back to the longest prefix it shares with the request's tokens."""
        tokens = request.all_token_ids
        seq = self.seqs.get(request.request_id)
        if seq is None:
            start = request.num_computed_tokens
            seq = self.seqs[request.request_id] = DraftSeq(request.request_id, list(tokens[:start]), start, start)
        # Blocks past the target's computed tokens may have been given back (rejected tokens) and taken
        # again since the draft wrote them: its KV there is trusted only up to the last block kept.
        kept = -(-request.num_computed_tokens // self.block_size) * self.block_size
        # The last token is always fed again: its logits give the first draft token. The draft may already
        # hold KV for it (its earlier proposals were dropped unverified and the target then sampled the
        # same token), and without this cap the catch-up would have nothing to compute. A catch-up cut by
        # the token budget may also leave num_confirmed above what has KV.
        limit = min(seq.num_computed_tokens, len(tokens) - 1, kept)
        matched = min(seq.num_confirmed, limit)
        while matched < limit and seq.all_token_ids[matched] == tokens[matched]:
            matched += 1
        seq.num_computed_tokens = matched
        del seq.all_token_ids[matched:]
        seq.all_token_ids.extend(tokens[matched:])
        seq.num_confirmed = len(tokens)
        return seq

    @torch.inference_mode()
    def propose(self, inputs: ProposeInput) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Up to num_spec_tokens[i] draft tokens for requests[i], with the distributions they were drawn
        from ([k, V]; None for greedy requests, whose verification needs only the tokens).

        inputs.catch_up: the scheduled requests that propose nothing (a prompt chunk the target computed
        without sampling, a request out of budget or near its limit); the draft computes their new tokens
        too, so its KV in their blocks is there when they propose (or a later request hits the blocks in
        the prefix cache). inputs.max_catch_up_tokens: the most tokens the catch-up pass computes (the
        step's token budget); a request whose catch-up does not fit catches up in part and proposes
        nothing this step."""
        requests = inputs.requests + inputs.catch_up
        num_spec_tokens = inputs.num_spec_tokens + [0] * len(inputs.catch_up)
        base_rows = inputs.sampling_rows
        seqs = [self._sync(request) for request in requests]
        # Greedy with nothing to adjust (no penalties, min_tokens met: drafts only lengthen the output), so
        # a draft token is the argmax of the raw logits, taken in the matmul's dtype (the same index: the
        # cast to float32 is exact), without building each pass's rows or the adjusted logits.
        plain = [row.params.greedy and not row.params.has_penalties and not holds_back_stops(row)
                 for row in base_rows] + [False] * len(inputs.catch_up)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_spec_tokens) if k > 0]
        feeding = active + [i for i, k in enumerate(num_spec_tokens) if k == 0]  # the catch-up pass
        allowance = inputs.max_catch_up_tokens
        while feeding:
            scheduled, stepping = [], []
            for i in feeding:
                seq = seqs[i]
                num_new = seq.num_tokens - seq.num_computed_tokens
                if num_new <= 0:
                    continue  # (a catch-up request the draft is level with)
                if allowance is not None:
                    num_new = min(num_new, allowance)
                    if num_new <= 0:
                        continue
                    allowance -= num_new
                reaches_end = seq.num_computed_tokens + num_new == seq.num_tokens
                # (the runner reads the request's block table from the target's tables)
                scheduled.append(ScheduledRequest(
                    request=seq, num_new_tokens=num_new, start_pos=seq.num_computed_tokens,  # type: ignore[arg-type]
                    block_ids=[], sample=reaches_end))
                if reaches_end and num_spec_tokens[i] > 0:
                    stepping.append(i)
            allowance = None  # the k-1 passes after the catch-up feed one token per proposing request
            if not scheduled:
                break
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
