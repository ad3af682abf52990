"""The suffix proposer and adaptive k (issue 46): lossless, bounded, and off where it does not pay.

- The suffix tree counts every substring of up to max_depth tokens, proposes the most frequent
  continuation while its confidence holds, and gives back every node a removed sequence held; the global
  tree never holds more than max_cached_requests outputs.
- With the suffix proposer, outputs are token for token those of plain decoding: greedy and seeded
  sampling, batches of mixed lengths, chunked prefill, prefix caching and preemption, on a model that
  repeats its input so that proposals are accepted.
- Adaptive k: a request whose proposals are rejected falls to k = 0 (its proposals are held back and
  compared with what the target samples), and its k comes back when they start matching; a step whose
  batch is large enough that a longer pass costs more than it saves speculates nothing.
"""

from __future__ import annotations

import pytest
from test_spec_decode import VOCAB, build_cycle_model, flat_step_cost, make_llm, mixed_batch, spec_values, token_ids
from tiny_models import build_model, metric_values, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.adaptive import StepCostModel, allocate_speculative_tokens
from pagedllm.spec_decode.suffix import SuffixProposer, SuffixTree

K = 4
SUFFIX = {"method": "suffix", "num_speculative_tokens": K}
CYCLE = list(range(100, 140))  # the cycle model's greedy continuation of CYCLE[i] is CYCLE[i + 1]


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_cycle_model(tmp_path_factory.mktemp("cycle"), CYCLE)


@pytest.fixture(scope="module")
def plain_cycle_llm(cycle_model: str):
    return make_llm(cycle_model)


def cycle_prompts() -> list[list[int]]:
    """Prompts that quote stretches of the cycle (so the model's continuation repeats the input), with
    other text around them, of different lengths."""
    noise = random_prompts(4, VOCAB, lengths=[5, 17, 2, 30], seed=3)
    return [noise[0] + CYCLE[:20] + CYCLE[:7], CYCLE[5:30] + noise[1] + CYCLE[5:9], noise[2] + CYCLE[30:33],
            CYCLE * 2 + noise[3] + CYCLE[:12]]


# --- the suffix tree --------------------------------------------------------------------------------------


def node_count(tree: SuffixTree) -> int:
    stack, count = [tree.root], 0
    while stack:
        node = stack.pop()
        count += 1
        assert node.total == sum(c.count for c in node.children.values())
        assert node is tree.root or node.count >= node.total
        if node.best is not None:  # the cached most frequent child is still one
            assert node.best[1].count == max(c.count for c in node.children.values())
        stack.extend(node.children.values())
    return count


def test_suffix_tree_counts_substrings_up_to_its_depth() -> None:
    tree = SuffixTree(max_depth=3)
    tree.extend("a", [1, 2, 1, 2])
    tree.extend("a", [3])  # appending token by token equals adding at once
    whole = SuffixTree(max_depth=3)
    whole.extend("b", [1, 2, 1, 2, 3])
    assert tree.num_nodes == whole.num_nodes == node_count(tree)
    assert tree.match([1, 2]).count == 2 and tree.match([2, 1]).count == 1
    assert tree.match([1, 2, 1]).count == 1 and tree.match([1, 2, 1, 2]) is None  # deeper than max_depth
    # no path is longer than max_depth: at most max_depth nodes per token, plus the root
    assert tree.num_nodes <= 3 * 5 + 1


def test_suffix_tree_proposes_the_most_frequent_continuation_while_confident() -> None:
    tree = SuffixTree(max_depth=8)
    tree.extend("a", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 1, 5, 6])
    candidate = tree.speculate([5, 6], 4, max_spec_factor=4.0, min_token_prob=0.1)
    # after [5, 6]: 7 twice, 9 once (the last occurrence has no continuation yet and does not count)
    assert candidate.token_ids == [7, 8, 5, 6]
    assert candidate.score == pytest.approx(2 / 3 * 4)  # each step keeps the first one's 2/3 confidence
    # a threshold above the first step's confidence stops before it
    assert tree.speculate([5, 6], 4, max_spec_factor=4.0, min_token_prob=0.7).token_ids == []
    # max_spec_factor bounds a proposal by the length of its match
    assert len(tree.speculate([1, 5, 6], 8, max_spec_factor=1.0, min_token_prob=0.0).token_ids) <= 3
    assert tree.speculate([42], 4, 1.0, 0.1).token_ids == []


def test_a_sequences_own_suffix_nodes_give_what_matching_gives() -> None:
    import random

    rng = random.Random(0)
    for _ in range(100):
        tree = SuffixTree(max_depth=rng.randint(2, 8))
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(1, 40))]
        tree.extend("s", tokens)
        walked = tree.speculate(tokens, 5, 1.5, 0.1)
        kept = tree.speculate(tokens, 5, 1.5, 0.1, tree.suffix_nodes("s"))
        assert (walked.token_ids, walked.score, walked.match_len) == (kept.token_ids, kept.score, kept.match_len)


def test_suffix_tree_remove_frees_every_node() -> None:
    tree = SuffixTree(max_depth=4)
    tree.extend("a", [1, 2, 3, 1, 2, 4])
    size_a = tree.num_nodes
    tree.extend("b", [9, 1, 2, 3, 7])
    assert tree.speculate([1, 2], 2, 2.0, 0.0).token_ids == [3, 1]  # caches each node's best child
    tree.remove("a")
    only_b = SuffixTree(max_depth=4)
    only_b.extend("b", [9, 1, 2, 3, 7])
    assert tree.num_nodes == only_b.num_nodes == node_count(tree)
    tree.remove("b")
    assert tree.num_nodes == 1 and not tree.root.children and size_a > 1


def test_global_tree_is_bounded_and_shared_across_requests() -> None:
    from pagedllm.spec_decode.proposer import DraftRequest, ProposeInput

    params = SamplingParams()
    proposer = SuffixProposer(max_tree_depth=6, max_cached_requests=2)
    # request a answered [7, 8, 9, 10, 11] to its prompt [1, 2]
    proposer.observe(DraftRequest("a", [1, 2, 7, 8, 9, 10, 11], params, num_prompt_tokens=2))
    proposer.free({"a"})
    assert "a" not in proposer.local and "a" in proposer.global_tree
    # a new request whose text reaches [7, 8] gets a's continuation from the global tree
    request = DraftRequest("b", [3, 4, 7, 8], params, num_prompt_tokens=4)
    assert proposer.propose(ProposeInput([request], [3], [])) == {"b": ([9, 10], None)}  # max_spec_factor 1: match of 2
    sizes = []
    for i in range(6):
        proposer.observe(DraftRequest(f"r{i}", [1] + list(range(20 + 10 * i, 28 + 10 * i)), params, 1))
        proposer.free({f"r{i}"})
        sizes.append(proposer.global_tree.num_nodes)
    assert list(proposer.cached) == ["r4", "r5"]  # the oldest outputs were evicted
    assert len(set(sizes[2:])) == 1  # bounded: each new output replaces an evicted one of the same shape
    assert proposer.global_tree.num_nodes == node_count(proposer.global_tree)
    assert list(proposer.local) == ["b"]  # only the request still running has a tree of its own


# --- lossless on the engine -------------------------------------------------------------------------------


def test_greedy_and_seeded_outputs_equal_plain_decoding(cycle_model: str, plain_cycle_llm) -> None:
    prompts = cycle_prompts()
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 12, 25, 40)]
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=24, ignore_eos=True)
              for i in range(4)]
    llm = make_llm(cycle_model, speculative_config=dict(SUFFIX))
    for params in (greedy, seeded):
        want = token_ids(plain_cycle_llm, prompts, params)
        assert token_ids(llm, prompts, params) == want
        assert token_ids(llm, prompts[::-1], params[::-1]) == want[::-1]  # another batch order
    values = spec_values(llm)
    assert values["num_accepted_tokens"] > 0.5 * values["num_draft_tokens"] > 0
    # text the model does not repeat (proposals mostly rejected)
    prompts, params = mixed_batch(2)
    assert token_ids(llm, prompts, params) == token_ids(plain_cycle_llm, prompts, params)


def test_chunked_prefill_prefix_caching_and_preemption(cycle_model: str, plain_cycle_llm) -> None:
    shared = CYCLE[:16]
    prompts = [shared + tail for tail in cycle_prompts()[:3]] + [shared + CYCLE[16:20], CYCLE[3:9]]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=20 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    want = token_ids(plain_cycle_llm, prompts, params)
    llm = make_llm(cycle_model, block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=40,
                   speculative_config=dict(SUFFIX, suffix_decoding_max_cached_requests=2))
    assert token_ids(llm, prompts, params) == want
    metrics = metric_values(llm)
    assert metrics["pagedllm:num_preemptions"] > 0
    assert metrics["pagedllm:prefix_cache_hits"] > 0
    assert metrics["pagedllm:spec_decode_num_accepted_tokens"] > 0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks
    proposer = llm.llm_engine.spec_decoder.proposer
    assert not proposer.local and len(proposer.cached) <= 2  # per-request trees freed, global tree bounded


# --- adaptive k -------------------------------------------------------------------------------------------


def trace_num_speculative_tokens(llm, request_id: str) -> list[int]:
    """k given to `request_id` at each step (-1: its proposal held back, k = 0)."""
    decoder = llm.llm_engine.spec_decoder
    trace: list[int] = []
    original = decoder.propose

    def propose(scheduled, output, sampled_token_ids) -> None:
        original(scheduled, output, sampled_token_ids)
        if request_id in sampled_token_ids:
            k = len(output.spec_token_ids.get(request_id, []))
            trace.append(-1 if request_id in decoder.unverified else k)

    decoder.propose = propose
    return trace


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_k_falls_to_zero_on_rejections_and_comes_back(cycle_model: str, plain_cycle_llm, method: str) -> None:
    """The prompt pairs every cycle token with a wrong successor, so until the output has gone round the
    cycle once every proposal is rejected; after that the output's own history proposes the right tokens."""
    prompt = [t for c in CYCLE for t in (c, c + 200)] * 2 + CYCLE[:1]
    params = SamplingParams(temperature=0.0, max_tokens=3 * len(CYCLE), ignore_eos=True)
    config = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = make_llm(cycle_model, speculative_config=config)
    assert llm.llm_engine.spec_decoder.adaptive, "adaptive k is the default for model-free proposers"
    flat_step_cost(llm)
    trace = trace_num_speculative_tokens(llm, "0")
    engine = llm.llm_engine
    engine.add_request("0", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.finished)
    assert outputs[0].outputs[0].token_ids == token_ids(plain_cycle_llm, [prompt], params)[0]
    first_zero = trace.index(-1)
    assert max(trace[:first_zero]) > 0, "speculation starts on"
    assert first_zero < len(CYCLE), "rejected proposals turn it off within the first round of the cycle"
    assert max(trace[first_zero:]) == K, "held-back proposals that match turn it back on"
    values = spec_values(llm)
    assert values["num_accepted_tokens"] > 0


def test_a_step_speculates_only_while_it_pays() -> None:
    flat = lambda n: 10.0 + 0.2 * n  # noqa: E731  (a pass costs little more per token)
    # batch 1: a likely proposal gets its tokens, an unlikely one none
    assert allocate_speculative_tokens([0.9], [5], 1, flat, budget=100) == [5]
    assert allocate_speculative_tokens([0.01], [5], 1, flat, budget=100) == [0]
    # the likeliest requests first, and no more than the budget
    assert allocate_speculative_tokens([0.3, 0.95], [4, 4], 2, flat, budget=3) == [0, 3]
    # a batch large enough that one more position costs more than the accepted tokens it brings
    steep = lambda n: 1.0 + 0.25 * n  # noqa: E731
    assert allocate_speculative_tokens([0.5], [4], 1, steep, budget=100)[0] > 0
    assert allocate_speculative_tokens([0.5] * 16, [4] * 16, 16, steep, budget=100) == [0] * 16


@pytest.mark.parametrize("cost_per_token, speculates", [(0.125, False), (0.2, False), (0.01, True), (0.06, True)])
def test_speculation_turns_off_at_batch_8_even_when_every_step_has_one_size(cost_per_token: float,
                                                                            speculates: bool) -> None:
    """Eight requests whose proposals always have 8 tokens (acceptance 0.6) make every speculating step the
    same size, from which the slope cannot be learned: the model takes a step without speculation now and
    then (baseline_due) and so learns that an extra position costs `cost_per_token` of a step. Where that
    is more than the acceptance brings, speculation stays off; where it is less, it stays on. Step times
    here are a given function of the step's size, never measured."""
    model, batch, step_s = StepCostModel(), 8, 0.03
    slope = cost_per_token * step_s
    speculated = []
    for _ in range(400):  # as SpecDecoder._allocate
        if model.baseline_due(batch):
            ks = [0] * batch
        else:
            ks = allocate_speculative_tokens([0.6] * batch, [8] * batch, batch, model.cost_function(), 10**6)
        num_tokens = batch + sum(ks)
        model.observe(num_tokens, step_s + slope * (num_tokens - batch))
        speculated.append(num_tokens > batch)
    share = sum(speculated[100:]) / 300
    assert share > 0.95 if speculates else share < 0.02


def test_step_cost_model_fits_measured_step_times() -> None:
    model = StepCostModel()
    assert model.fit() is None
    for step in range(200):
        n = 1 + step % 6
        model.observe(n, 0.017 + 0.0004 * n)
    a, b = model.fit()
    assert a == pytest.approx(0.017, rel=0.05) and b == pytest.approx(0.0004, rel=0.1)
    cost = model.cost_function()
    assert cost(6) > cost(1) > 0
    # only one size measured: the slope is the prior's share of it, never zero
    flat = StepCostModel()
    for _ in range(50):
        flat.observe(1, 0.02)
    assert 0 < flat.fit()[1] < 0.02


# --- configuration ----------------------------------------------------------------------------------------


def test_suffix_config(cycle_model: str) -> None:
    llm = make_llm(cycle_model, speculative_config={"method": "suffix", "suffix_decoding_max_tree_depth": 16,
                                                    "suffix_decoding_min_token_prob": 0.2})
    config = llm.llm_engine.spec_decoder.config
    assert config.num_speculative_tokens == 16  # vLLM: k defaults to the tree's depth
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_min_token_prob) == (16, 0.2)
    assert config.adaptive_num_speculative_tokens
    fixed = make_llm(cycle_model, speculative_config=dict(SUFFIX, adaptive_num_speculative_tokens=False))
    assert not fixed.llm_engine.spec_decoder.adaptive
    for bad, field in ((dict(SUFFIX, suffix_decoding_max_tree_depth=1), "suffix_decoding_max_tree_depth"),
                       (dict(SUFFIX, suffix_decoding_max_cached_requests=-1), "suffix_decoding_max_cached_requests"),
                       (dict(SUFFIX, suffix_decoding_min_token_prob=1.5), "suffix_decoding_min_token_prob"),
                       (dict(SUFFIX, suffix_decoding_max_spec_factor=0), "suffix_decoding_max_spec_factor"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
                        "apply to method 'suffix'")):
        with pytest.raises(ValueError, match=field):
            make_llm(cycle_model, speculative_config=bad)



# --- verification computes each position as plain decoding does ------------------------------------------


@pytest.mark.parametrize("backend", ["CPU_FLASH", "TORCH_FLASH"])
def test_verification_logits_equal_plain_decodings_in_bf16(tmp_path_factory: pytest.TempPathFactory,
                                                          backend: str) -> None:
    """Each of a verifying request's k+1 positions is attended to as a one-token query, as in plain
    decoding, so its logits are the same to the bit (bf16 logits tie often; a last-bit difference from a
    multi-row attention path flipped near-ties and the outputs differed from plain decoding's). The draft
    is the target itself, so every step verifies k+1 positions."""
    # SmolLM2-135M's attention shape (head_dim 64, 3 query heads per KV head), two layers
    model = build_model(tmp_path_factory.mktemp("gqa3"), "llama", seed=4, hidden_size=192, num_attention_heads=3,
                        num_key_value_heads=1, head_dim=64, intermediate_size=256, num_hidden_layers=2)
    prompts = random_prompts(3, VOCAB, lengths=[40, 7, 90], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    common = dict(dtype="bfloat16", attention_backend=backend, max_model_len=512, seed=0)
    plain = LLM(model=model, **common).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, speculative_model=model, num_speculative_tokens=8, **common)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert spec_values(llm)["num_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert [list(d.values())[0].logprob for d in a.outputs[0].logprobs] == \
            [list(d.values())[0].logprob for d in b.outputs[0].logprobs]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_request_that_never_speculates_asks_the_proposer_rarely(tiny_llama_dir: str, method: str) -> None:
    """After IDLE_AFTER_STEPS steps without speculation a request proposes only every PROBE_EVERY_STEPS
    steps: text that matches nothing costs little proposing."""
    from pagedllm.spec_decode.spec_decoder import IDLE_AFTER_STEPS, PROBE_EVERY_STEPS

    llm = make_llm(tiny_llama_dir, speculative_config={"method": method, "num_speculative_tokens": K})
    proposer = llm.llm_engine.spec_decoder.proposer
    asked = []
    original = proposer.propose

    def propose(inputs):
        asked.extend(r.request_id for r in inputs.requests)
        return original(inputs)

    proposer.propose = propose
    # a random model's random continuation: nothing in it repeats
    prompts = random_prompts(1, VOCAB, lengths=[12], seed=31)
    max_tokens = 60
    plain = token_ids(make_llm(tiny_llama_dir), prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    got = token_ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    assert got == plain
    steps = len(got[0]) - 1
    assert llm.llm_engine.spec_decoder.stats.num_accepted_tokens == 0
    assert len(asked) <= IDLE_AFTER_STEPS + steps / PROBE_EVERY_STEPS + 2 < steps
