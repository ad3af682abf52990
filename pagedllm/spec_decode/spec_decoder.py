"""Speculative decoding inside the model runner (as in vLLM V1): verify the last proposals, propose the next.

The target's ModelRunner owns a SpecDecoder (on rank 0 only under tensor parallelism). In step N the
runner computes, for every request carrying k proposals, all k+1 positions in its one forward pass and
hands their logits to `verify`, which builds p (the request's own sampling distribution at each
position), runs the rejection sampler against q (what the proposer drew from; a seeded request is
instead checked against the target's own seeded sample at each position), and returns the accepted
tokens plus one correction or bonus token. Then, still in step N, `propose` drafts up to k tokens past
them for every request that sampled; they travel back to the engine in ModelRunnerOutput.spec_token_ids,
the scheduler stores them in `request.spec_token_ids`, and step N+1's plan counts them as extra tokens of
the request inside the token budget. The scheduler rolls back the KV of rejected tokens, and drops the
proposals of requests that finished.

Draft placement under tensor parallelism: the draft runs unsharded on rank 0 only (vLLM's
draft_tensor_parallel_size=1). A draft is small, so splitting it would add two all-reduces per draft
layer per draft token, costing more than its matmuls save; the other ranks just compute the k+1
positions they are sent, and only rank 0, which gathers the logits, verifies.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedllm.config import SchedulerConfig
from pagedllm.core_types.model_runner_output import ModelRunnerOutput
from pagedllm.core_types.scheduler_output import ScheduledRequest
from pagedllm.layers.sampler import SamplingRow, argmax_rows, logprob_stats, processed_probs, seeded_sample, select_rows
from pagedllm.metrics.reader import Counter, Gauge, Metric
from pagedllm.outputs import position_logprobs
from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.spec_decode.adaptive import AcceptanceEstimate, StepCostModel, allocate_speculative_tokens
from pagedllm.spec_decode.adaptive import speculative_tokens_per_pass as expected_tokens_per_pass
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.proposer import DraftRequest, DraftRunner, ProposeInput, Proposer
from pagedllm.spec_decode.rejection_sampler import (
    RejectionResult,
    adjusted_logits,
    greedy_accept,
    rejection_sample,
    rows_with_drafts,
)
from pagedllm.spec_decode.suffix import SuffixProposer
from pagedllm.structured_output import GrammarBitmask

# Model-free adaptive k: a request that has not speculated for this many steps proposes only every
# PROBE_EVERY_STEPS steps (see SpecDecoder._idles).
IDLE_AFTER_STEPS = 8
PROBE_EVERY_STEPS = 4
# Adaptive k with a draft model (adaptive.py for the model-free proposers): a request's acceptance is
# estimated from its own recent verifications (AcceptanceEstimate: a prior of 0.6, the agreement measured
# for an independently trained draft, the 1.4M-parameter demo draft with its 12.6M target), and k in
# 1..num_speculative_tokens maximizes tokens per unit of time, a draft token costing draft_cost_per_token.


def best_num_speculative_tokens(alpha: float, max_k: int, cost_per_token: float) -> int:
    """The k in 1..max_k with the most tokens per unit of time, a pass costing 1 + cost_per_token * k."""
    return max(range(1, max_k + 1), key=lambda k: expected_tokens_per_pass(alpha, k) / (1 + cost_per_token * k))


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0            # verifications of a request that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0    # accepted + correction/bonus, before stop and length cuts
    num_fully_accepted: int = 0    # drafts whose every token was accepted (the others had one rejection)
    num_target_passes: int = 0     # target forward passes that verified anything
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    # By draft length k (index k - 1): drafts, their accepted tokens, and those accepted whole.
    drafts_by_len: list[int] = field(default_factory=list)
    accepted_by_len: list[int] = field(default_factory=list)
    fully_accepted_by_len: list[int] = field(default_factory=list)
    # Wall-clock split, for benchmarks: where a speculative step's time goes.
    num_steps: int = 0             # engine steps (target passes of any kind)
    num_verify_steps: int = 0      # target passes that verified proposals (no prefill cost mixed in at batch 1)
    # Adaptive k of a model-free proposer: proposals held back (k = 0) and compared with the sampled token.
    num_unverified_trials: int = 0
    num_unverified_matches: int = 0
    num_propose_calls: int = 0     # propose() calls that proposed for at least one request
    execute_s: float = 0.0         # target pass: prepare, forward, sample/verify
    verify_execute_s: float = 0.0  # the part of execute_s spent in steps that verified proposals
    propose_s: float = 0.0         # proposer: draft passes or n-gram lookups

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens
        self.drafted_per_pos = [0] * self.num_speculative_tokens
        self.drafts_by_len = [0] * self.num_speculative_tokens
        self.accepted_by_len = [0] * self.num_speculative_tokens
        self.fully_accepted_by_len = [0] * self.num_speculative_tokens

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        self.num_fully_accepted += num_accepted == num_draft
        self.drafts_by_len[num_draft - 1] += 1
        self.accepted_by_len[num_draft - 1] += num_accepted
        self.fully_accepted_by_len[num_draft - 1] += num_accepted == num_draft
        for pos in range(num_draft):
            self.drafted_per_pos[pos] += 1
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """alpha of the seed's formula: the chance a draft token is accepted given its position was reached
        (accepted tokens over accepted tokens plus rejections)."""
        trials = self.num_accepted_tokens + self.num_drafts - self.num_fully_accepted
        return self.num_accepted_tokens / trials if trials else 0.0

    def expected_tokens_per_pass(self) -> float:
        """The seed's formula (1 - alpha^(k+1)) / (1 - alpha), averaged over the verified drafts, each at its
        own k and the per-token acceptance measured on drafts of that length (k adapts, and a proposer's
        longer drafts are its more confident ones: one alpha for all would understate them)."""
        if not self.num_drafts:
            return 0.0
        total = 0.0
        for k, (num, accepted, full) in enumerate(zip(self.drafts_by_len, self.accepted_by_len,
                                                      self.fully_accepted_by_len), start=1):
            if num:
                trials = accepted + num - full
                total += num * expected_tokens_per_pass(accepted / trials if trials else 1.0, k)
        return total / self.num_drafts

    @property
    def mean_tokens_per_pass(self) -> float:
        """Tokens one request gets from one verifying target pass (1 + accepted), on average."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


def make_proposer(config: SpeculativeConfig, draft_runner: DraftRunner | None) -> Proposer:
    """The proposer of config.method; a draft model's runner comes from the worker (method draft_model)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    assert config.method == "draft_model" and draft_runner is not None, "method draft_model needs the draft's runner"
    return DraftModelProposer(draft_runner)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, scheduler_config: SchedulerConfig, generator: torch.Generator,
                 target_num_layers: int, target_weight_bytes: int, draft_runner: DraftRunner | None = None):
        """generator: the target sampler's (rejection sampling draws from it); the target's layers and
        weight bytes price a draft token; draft_runner: the draft model's, made by the worker (method
        draft_model only)."""
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.scheduler_config = scheduler_config
        self.generator = generator
        self.proposer = make_proposer(config, draft_runner)
        # q of the current proposals, per request (a proposer that samples its drafts, non-greedy requests only).
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.adaptive = config.adaptive_num_speculative_tokens
        self.model_free = self.proposer.model_free
        self.keeps_kv = self.proposer.kv_cache_bytes_per_block() > 0
        # Cost of one draft token relative to a target pass, fixed at start-up.
        self.draft_cost_per_token = self.proposer.cost_per_token(target_num_layers, target_weight_bytes)
        self.acceptance: dict[str, AcceptanceEstimate] = {}
        # Model-free adaptive k: the measured cost of a target pass by its size, and the proposal held
        # back from each request at k = 0 (its first token), compared with what the target samples next.
        self.step_cost = StepCostModel()
        self.unverified: dict[str, int] = {}
        self.num_idle_steps: dict[str, int] = {}  # consecutive steps a request did not speculate
        self._last_step_s = 0.0
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    # ---- the runner's hooks ----
    def draft_kv_cache_bytes_per_block(self) -> int:
        """What the proposer's KV adds to each target KV block (its cache has a block for each of the target's)."""
        return self.proposer.kv_cache_bytes_per_block()

    def allocate(self, num_blocks: int) -> None:
        self.proposer.allocate_kv_cache(num_blocks)

    def record_step(self, elapsed_s: float, output: ModelRunnerOutput) -> None:
        self._last_step_s = elapsed_s
        self.stats.execute_s += elapsed_s
        self.stats.num_steps += 1
        if output.num_draft_tokens:
            self.stats.verify_execute_s += elapsed_s
            self.stats.num_verify_steps += 1

    def free_requests(self, request_ids: Iterable[str]) -> None:
        """Forget requests that finished or were preempted (the draft's KV goes with their blocks)."""
        request_ids = set(request_ids)
        self.proposer.free(request_ids)
        for request_id in request_ids:
            self.acceptance.pop(request_id, None)
            self.draft_probs.pop(request_id, None)
            self.unverified.pop(request_id, None)
            self.num_idle_steps.pop(request_id, None)

    def propose(self, scheduled: list[ScheduledRequest], output: ModelRunnerOutput,
                sampled_token_ids: dict[str, list[int]]) -> None:
        """Draft past this step's sampled tokens (by request id, for the requests that sampled) for every
        request that sampled; into output.spec_token_ids."""
        sampled = [s for s in scheduled if s.request.request_id in sampled_token_ids]
        allocate = self.model_free and self.adaptive  # k from the proposals, acceptance and step cost
        if allocate:
            self._observe_step(scheduled, sampled, sampled_token_ids)
        # Decodes are scheduled first; keep all of them with their proposals inside one step's budget, so
        # the scheduler never has to cut a request's proposals short.
        budget = self.scheduler_config.max_num_batched_tokens - len(sampled)
        max_model_len = self.scheduler_config.max_model_len
        candidates: list[DraftRequest] = []
        base_rows: list[SamplingRow] = []
        num_spec_tokens: list[int] = []
        # A proposer keeping KV computes every scheduled request's new tokens in the step the target does
        # (a prompt chunk, a request proposing nothing this step), within the step's token budget.
        catch_up: list[DraftRequest] = []
        keeps_kv = self.keeps_kv
        for s in scheduled:
            request = s.request
            new_tokens = sampled_token_ids.get(request.request_id)
            if new_tokens is None:
                if keeps_kv:
                    catch_up.append(DraftRequest(request.request_id,
                                                 request.all_token_ids[:s.start_pos + s.num_new_tokens],
                                                 request.sampling_params, num_computed_tokens=s.start_pos))
                continue
            # (the runner appended the sampled tokens to the request's before this pass)
            all_token_ids = request.all_token_ids
            output_token_ids = request.output_token_ids
            num_output_tokens = len(output_token_ids)
            k = min(self.num_speculative_tokens_for(request.request_id), max_model_len - len(all_token_ids) - 1)
            if not allocate:
                k = min(k, budget)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                k = min(k, max_tokens - num_output_tokens - 1)  # never draft past the length limit
            self.draft_probs.pop(request.request_id, None)
            draft_request = DraftRequest(request.request_id, all_token_ids, request.sampling_params,
                                         request.num_prompt_tokens, s.start_pos)
            if k <= 0 or (allocate and self._idles(request.request_id)):
                if keeps_kv:
                    catch_up.append(draft_request)
                continue
            if not allocate:
                budget -= k
            candidates.append(draft_request)
            base_rows.append(SamplingRow(request.sampling_params, request.prompt_token_ids,
                                         output_token_ids,
                                         list(request.sampling_params.all_stop_token_ids)))
            num_spec_tokens.append(k)
        if not candidates and not catch_up:
            return
        start = time.perf_counter()
        proposals = self.proposer.propose(ProposeInput(candidates, num_spec_tokens, base_rows, catch_up,
                                                       self.scheduler_config.max_num_batched_tokens))
        self.stats.propose_s += time.perf_counter() - start
        self.stats.num_propose_calls += bool(candidates)
        if allocate:
            proposals = self._allocate(candidates, proposals, len(sampled), budget)  # type: ignore[arg-type]
        for request in candidates:
            tokens, q = proposals.get(request.request_id, ([], None))
            if tokens:
                output.spec_token_ids[request.request_id] = tokens
            if q is not None:
                self.draft_probs[request.request_id] = q

    def num_speculative_tokens_for(self, request_id: str) -> int:
        """The most tokens to ask the proposer for (a model-free proposer's k is cut later, in _allocate)."""
        if not self.adaptive or self.model_free:
            return self.num_speculative_tokens
        alpha = self.acceptance[request_id].alpha if request_id in self.acceptance else AcceptanceEstimate().alpha
        return best_num_speculative_tokens(alpha, self.num_speculative_tokens, self.draft_cost_per_token)

    def _record_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        estimate = self.acceptance.get(request_id)
        if estimate is None:
            estimate = self.acceptance[request_id] = AcceptanceEstimate()
        estimate.record(num_draft, num_accepted)

    def _observe_step(self, scheduled: list[ScheduledRequest], sampled: list[ScheduledRequest],
                      sampled_token_ids: dict[str, list[int]]) -> None:
        """Learn from the step that just ran: its time (a decode step: every request computed its last
        token and its proposals, no prompt chunk), and whether each held-back proposal matched."""
        if len(sampled) == len(scheduled) and all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in scheduled):
            self.step_cost.observe(sum(s.num_new_tokens for s in scheduled), self._last_step_s)
        if not self.unverified:
            return
        for s in sampled:
            request_id = s.request.request_id
            held_back = self.unverified.pop(request_id, None)
            if held_back is not None:
                matched = sampled_token_ids[request_id][0] == held_back
                self._record_acceptance(request_id, 1, int(matched))
                self.stats.num_unverified_trials += 1
                self.stats.num_unverified_matches += matched

    def _idles(self, request_id: str) -> bool:
        """Whether a request that has not speculated for a while skips proposing this step: after
        IDLE_AFTER_STEPS steps without speculation it proposes (and compares a held-back proposal) only
        every PROBE_EVERY_STEPS steps, so text that matches nothing (open-ended chat) costs the proposer
        little, while a request that starts repeating its input is noticed within a few steps."""
        misses = self.num_idle_steps.get(request_id, 0)
        if misses >= IDLE_AFTER_STEPS and misses % PROBE_EVERY_STEPS:
            self.num_idle_steps[request_id] = misses + 1
            return True
        return False

    def _allocate(self, candidates: list[DraftRequest], proposals: dict[str, tuple[list[int], None]],
                  num_base_tokens: int, budget: int) -> dict[str, tuple[list[int], None]]:
        """Cut each proposal to the k that adaptive.allocate_speculative_tokens gives its request; hold back
        the first token of a proposal cut to nothing, to compare with the token the target samples."""
        proposed = [request for request in candidates if request.request_id in proposals]
        alphas = [self.acceptance[r.request_id].alpha if r.request_id in self.acceptance
                  else AcceptanceEstimate().alpha for r in proposed]
        lengths = [len(proposals[r.request_id][0]) for r in proposed]
        if self.step_cost.baseline_due(num_base_tokens):
            ks = [0] * len(proposed)  # a step without speculation, for the cost model (baseline_due)
        else:
            ks = allocate_speculative_tokens(alphas, lengths, num_base_tokens, self.step_cost.cost_function(), budget)
        kept: dict[str, tuple[list[int], None]] = {}
        for request, k in zip(proposed, ks):
            tokens = proposals[request.request_id][0]
            if k:
                kept[request.request_id] = (tokens[:k], None)
            else:
                self.unverified[request.request_id] = tokens[0]
        for request in candidates:
            speculates = request.request_id in kept
            self.num_idle_steps[request.request_id] = 0 if speculates else \
                self.num_idle_steps.get(request.request_id, 0) + 1
        return kept

    # ---- called by the target runner with the logits of the k+1 positions of every verified request ----
    def verify(self, verify: list[tuple[ScheduledRequest, int]], base_rows: list[SamplingRow], logits: torch.Tensor,
               output: ModelRunnerOutput, grammar_bitmask: GrammarBitmask | None = None) -> dict[str, list[int]]:
        """The tokens each of `verify`'s requests emits (its accepted proposals and the bonus token), by
        request id; their counts and logprobs go into `output`. base_rows[i]: the target runner's sampling
        row of verify[i]'s request."""
        rows = []
        for (s, _), base_row in zip(verify, base_rows):
            rows.extend(rows_with_drafts(base_row, s.spec_token_ids, len(s.spec_token_ids) + 1))
        # Under a grammar p is the masked target distribution at every position, so a draft token the
        # grammar refuses has p = 0 and is rejected, and the output stays a sample of the constrained target.
        token_bitmask = None
        if grammar_bitmask is not None:
            starts = [0]
            for s, _ in verify:
                starts.append(starts[-1] + len(s.spec_token_ids) + 1)
            token_bitmask = grammar_bitmask.select((s.request.request_id, start, len(s.spec_token_ids) + 1)
                                                   for (s, _), start in zip(verify, starts))
        adjusted = adjusted_logits(logits, rows, token_bitmask)
        # Seeded rows: the target's own sample at each position, drawn as plain sampling draws it there, so
        # the output never depends on what was proposed (rejection_sampler.py). Unseeded random rows are
        # verified by rejection sampling against the target's distribution.
        seeded = [i for i, r in enumerate(rows) if not r.params.greedy and r.seeded]
        # what greedy rows take (a full pass over k+1 rows of logits, skipped when every row is seeded)
        target_ids = argmax_rows(adjusted) if len(seeded) < len(rows) else \
            torch.empty(len(rows), dtype=torch.long, device=adjusted.device)
        if seeded:
            target_ids[seeded] = seeded_sample(select_rows(adjusted, seeded), [rows[i] for i in seeded])
        unseeded = [i for i, r in enumerate(rows) if not r.params.greedy and not r.seeded]
        probs = processed_probs(adjusted, rows) if unseeded else None
        target_ids = target_ids.tolist()

        self.stats.num_target_passes += 1
        emitted: list[tuple[ScheduledRequest, RejectionResult, int]] = []
        offset = 0
        for s, _ in verify:
            request = s.request
            spec = s.spec_token_ids
            k = len(spec)
            if request.sampling_params.greedy:
                result = greedy_accept(target_ids[offset:offset + k + 1], spec)
            elif request.sampling_params.seed is not None:
                self.draft_probs.pop(request.request_id, None)
                result = greedy_accept(target_ids[offset:offset + k + 1], spec)
            else:
                assert probs is not None
                q = self.draft_probs.pop(request.request_id, None)
                if self.proposer.samples_drafts:
                    assert q is not None and q.shape[0] >= k, "a sampled draft must come with its q"
                    q = q[:k]
                result = rejection_sample(probs[offset:offset + k + 1], spec, q, self.generator)
            self.stats.record(k, result.num_accepted)
            if self.adaptive:
                self._record_acceptance(request.request_id, k, result.num_accepted)
            output.num_draft_tokens[request.request_id] = k
            output.num_accepted_tokens[request.request_id] = result.num_accepted
            emitted.append((s, result, offset))
            offset += k + 1
        self._write_logprobs(emitted, logits, output)
        return {s.request.request_id: result.token_ids for s, result, _ in emitted}

    def _write_logprobs(self, emitted: list[tuple[ScheduledRequest, RejectionResult, int]],
                        logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        """The raw-model logprobs of the emitted tokens whose request asked for logprobs (row j of a request
        scored token j)."""
        wants = [s.request.sampling_params.logprobs for s, _, _ in emitted]
        max_logprobs = max((n for n in wants if n is not None), default=None)
        if max_logprobs is None:
            return  # nobody reads them: skip the full-vocabulary log-softmax
        rows = [offset + j for _, result, offset in emitted for j in range(len(result.token_ids))]
        tokens = [t for _, result, _ in emitted for t in result.token_ids]
        rows_t = torch.tensor(rows, dtype=torch.long, device=logits.device)
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        # (the plain sampler's function: a token's logprobs are the same bits whether it was verified or sampled)
        chosen, top_lp_t, top_ids_t, ranks_t = logprob_stats(logits[rows_t], tokens_t, max_logprobs)
        chosen_list, ranks = chosen.tolist(), ranks_t.tolist()
        top_lp = top_ids = None
        if max_logprobs > 0:
            top_lp, top_ids = top_lp_t.tolist(), top_ids_t.tolist()
        i = 0
        for (s, result, _), num_lp in zip(emitted, wants):
            rid = s.request.request_id
            n = len(result.token_ids)
            if num_lp is not None:
                output.sampled_logprobs[rid] = chosen_list[i:i + n]
                output.logprobs[rid] = [
                    position_logprobs(tokens[j], chosen_list[j], ranks[j], top_ids[j][:num_lp] if num_lp else [],
                                      top_lp[j][:num_lp] if num_lp else [])
                    for j in range(i, i + n)]
            i += n

    # ---- metrics ----
    def metrics(self) -> list[Metric]:
        st = self.stats
        metrics: list[Metric] = [
            Counter("pagedllm:spec_decode_num_drafts", st.num_drafts),
            Counter("pagedllm:spec_decode_num_draft_tokens", st.num_draft_tokens),
            Counter("pagedllm:spec_decode_num_accepted_tokens", st.num_accepted_tokens),
            Counter("pagedllm:spec_decode_num_emitted_tokens", st.num_emitted_tokens),
            Counter("pagedllm:spec_decode_num_target_passes", st.num_target_passes),
            Gauge("pagedllm:spec_decode_draft_acceptance_rate", st.acceptance_rate),
            Gauge("pagedllm:spec_decode_mean_tokens_per_pass", st.mean_tokens_per_pass),
        ]
        for pos in range(st.num_speculative_tokens):
            labels = {"position": str(pos)}
            metrics.append(Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos", st.accepted_per_pos[pos],
                                   labels))
            metrics.append(Counter("pagedllm:spec_decode_num_draft_tokens_per_pos", st.drafted_per_pos[pos],
                                   dict(labels)))
        return metrics
