"""Sampling behaviour (issue 3, "Engine core").

Seeded requests are reproducible alone and in a batch; top_k=1 is greedy; sampled frequencies follow
the model's softmax (chi-square against transformers' logits on a 12-token vocabulary); stop strings,
stop token ids, eos and max_tokens end requests with vLLM's finish reasons; n and logprobs return
vLLM-shaped outputs.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_logits, load_hf, random_prompts

from pagedllm import LLM, SamplingParams

VOCAB = 512  # tiny_llama_dir's BPE vocabulary
TINY_VOCAB = 12  # tiny_vocab_dir
EOS_ID = 1  # tiny_models.SPECIAL_TOKENS order: bos, eos, pad
NUM_DRAWS = 2000
P_VALUE_FLOOR = 1e-3  # a correct sampler fails one run in a thousand; seeds are fixed, so never flaky


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", seed=0, max_model_len=512)


@pytest.fixture(scope="module")
def tiny_llm(tiny_vocab_dir: str) -> LLM:
    return LLM(model=tiny_vocab_dir, dtype="float32", seed=0, max_model_len=256)


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# --- reproducibility ---------------------------------------------------------------------------------


def test_seeded_request_same_alone_and_batched(llm: LLM) -> None:
    prompts = random_prompts(8, VOCAB, seed=30)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].outputs[0]

    others = [
        SamplingParams(temperature=1.0, max_tokens=8 + i, ignore_eos=True) if i % 2 else greedy(8)
        for i in range(len(prompts))
    ]
    others[3] = seeded
    batched = llm.generate(prompts, others, use_tqdm=False)[3].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.text == alone.text

    again = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == alone.token_ids
    reseeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=4321, max_tokens=16, ignore_eos=True)
    other_seed = llm.generate([prompts[3]], reseeded, use_tqdm=False)[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids, "a different seed should give a different sample"


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_k=1),
        dict(temperature=0.7, top_p=1e-6),
        dict(temperature=1.3, min_p=1.0),
    ],
    ids=["top_k1", "top_p_tiny", "min_p1"],
)
def test_degenerate_sampling_equals_greedy(llm: LLM, params: dict) -> None:
    prompts = random_prompts(4, VOCAB, seed=31)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **params)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want


# --- distribution: chi-square against transformers' softmax ----------------------------------------------


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < 5 are pooled into one."""
    n = counts.sum().item()
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, f"sampled tokens {impossible.nonzero().flatten().tolist()} of p = 0"
    expected = probs * n
    small = (expected < 5) & ~impossible
    obs_bins = counts[~small & ~impossible].tolist()
    exp_bins = expected[~small & ~impossible].tolist()
    if small.any():
        obs_bins.append(counts[small].sum().item())
        exp_bins.append(expected[small].sum().item())
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_bins, exp_bins))
    df = len(obs_bins) - 1
    if df == 0:
        return 1.0
    return 1.0 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(torch.tensor(stat)).item()


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The distribution vLLM (V1) samples from, in its order: temperature; min-p against the full
    distribution; top-k; then top-p over what top-k left, renormalized. The order matters when combined."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    order = torch.argsort(probs, descending=True)
    if top_k > 0:
        probs[order[top_k:]] = 0.0
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_probs = probs[order]
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of strictly better tokens
        probs[order[mass_before >= top_p]] = 0.0
        probs = probs / probs.sum()
    return probs


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.6),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.0, top_p=0.7),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=1.0, top_k=100),  # larger than the vocabulary: no filtering
        dict(temperature=1.5, top_k=5, top_p=0.8, min_p=0.05),
    ],
    ids=["t1", "t0.6", "top_k3", "top_p0.7", "min_p0.1", "top_k_over_vocab", "all_filters"],
)
def test_first_token_frequencies_match_softmax(tiny_llm: LLM, tiny_vocab_dir: str, params: dict) -> None:
    prompt = [3, 4, 5, 6]
    probs = filtered_probs(hf_logits(tiny_vocab_dir, prompt)[-1], **params)
    assert probs.max() < 0.9, "the tiny model must not be nearly deterministic, or the test proves nothing"
    sp = [SamplingParams(max_tokens=1, ignore_eos=True, seed=i, **params) for i in range(NUM_DRAWS)]
    outs = tiny_llm.generate([prompt] * NUM_DRAWS, sp, use_tqdm=False)
    first = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    counts = torch.bincount(first, minlength=TINY_VOCAB).double()
    p_value = chi_square_p_value(counts, probs)
    assert p_value > P_VALUE_FLOOR, f"counts {counts.tolist()} vs expected {(probs * NUM_DRAWS).tolist()}"


def test_unseeded_n_samples_match_softmax(tiny_llm: LLM, tiny_vocab_dir: str) -> None:
    """One request with large n: its samples are independent draws from the same distribution."""
    prompt = [7, 3, 9]
    probs = filtered_probs(hf_logits(tiny_vocab_dir, prompt)[-1], temperature=1.0)
    out = tiny_llm.generate([prompt], SamplingParams(n=200, max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    assert sorted(c.index for c in out.outputs) == list(range(200))
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=TINY_VOCAB)
    assert chi_square_p_value(counts.double(), probs) > P_VALUE_FLOOR


# --- finish reasons -------------------------------------------------------------------------------------


def _stop_candidate(text: str, length: int = 2) -> tuple[int, str] | None:
    """A printable substring of `length` first occurring after position 0.

    Random tokens decode to text with U+FFFD for invalid bytes; those are final (no later byte completes
    them), so the text before the cut is the same whether or not generation stops there.

    Length 2 usually sits inside one token; length 6 usually spans several, so the match only completes
    on a later token than the one where it starts."""
    for i in range(1, len(text) - length):
        cand = text[i : i + length]
        if cand.isprintable() and cand.strip() == cand and text.find(cand) == i and "\ufffd" not in cand:
            return i, cand
    return None


@pytest.mark.parametrize("length", [2, 6])
def test_stop_strings(llm: LLM, length: int) -> None:
    prompts = random_prompts(10, VOCAB, seed=32)
    full = llm.generate(prompts, greedy(24), use_tqdm=False)
    checked = 0
    for prompt, out in zip(prompts, full):
        text = out.outputs[0].text
        found = _stop_candidate(text, length)
        if found is None:
            continue
        pos, stop = found
        res = llm.generate([prompt], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert res.finish_reason == "stop"
        assert res.stop_reason == stop
        assert res.text == text[:pos], "the stop string and what follows must be cut"
        assert res.token_ids == out.outputs[0].token_ids[: len(res.token_ids)]
        assert len(res.token_ids) < len(out.outputs[0].token_ids), "generation ends at the stop string"
        kept = llm.generate([prompt], greedy(24, stop=stop, include_stop_str_in_output=True), use_tqdm=False)
        assert kept[0].outputs[0].text == text[: pos + len(stop)]
        assert kept[0].outputs[0].finish_reason == "stop"
        # Of two stop strings, the earlier match wins; an absent one is harmless.
        two = llm.generate([prompt], greedy(24, stop=["\x00never\x00", stop]), use_tqdm=False)[0].outputs[0]
        assert two.text == text[:pos] and two.stop_reason == stop
        checked += 1
    assert checked >= 2, "too few prompts produced printable text to cut"


def test_min_tokens_holds_back_stop_strings(llm: LLM) -> None:
    """As vLLM: a stop string completed within the first min_tokens tokens is text like any other."""
    prompts = random_prompts(10, VOCAB, seed=32)
    checked = 0
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(24), use_tqdm=False)):
        found = _stop_candidate(out.outputs[0].text, 2)
        if found is None:
            continue
        pos, stop = found
        cut = llm.generate([prompt], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
        min_tokens = len(cut.token_ids) + 2
        held = llm.generate([prompt], greedy(24, stop=[stop], min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
        assert len(held.token_ids) >= min_tokens and held.text.startswith(out.outputs[0].text[:pos + len(stop)])
        assert held.token_ids == out.outputs[0].token_ids[:len(held.token_ids)]
        checked += 1
    assert checked >= 2, "too few prompts produced printable text to cut"


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm: LLM) -> None:
    """As vLLM: the stop token that ends a sample is its last token but not part of its text, unless
    include_stop_str_in_output (the same for EOS with skip_special_tokens=False)."""
    tok = llm.get_tokenizer()
    prompts = random_prompts(6, VOCAB, [20] * 6, seed=36)
    checked = 0
    for prompt in prompts:
        full = llm.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].token_ids
        # a token whose text shows (it completes its characters)
        j = next((i for i in range(4, len(full)) if full[i] not in full[:i] and not
                  tok.decode(full[:i + 1]).endswith("\ufffd") and tok.decode(full[:i + 1]) != tok.decode(full[:i])),
                 None)
        if j is None:
            continue
        cut = llm.generate([prompt], greedy(24, stop_token_ids=[full[j]], logprobs=0), use_tqdm=False)[0].outputs[0]
        kept = llm.generate([prompt], greedy(24, stop_token_ids=[full[j]], include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        assert cut.token_ids == kept.token_ids == full[:j + 1] and len(cut.logprobs) == j + 1
        before, through = (llm.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0].text for n in (j, j + 1))
        assert (cut.text, kept.text) == (before, through) and before != through
        checked += 1
    assert checked >= 2


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = random_prompts(1, VOCAB, [20], seed=33)[0]
    full = llm.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    j = next(i for i in range(4, len(full)) if full[i] not in full[:i])
    res = llm.generate([prompt], greedy(24, stop_token_ids=[full[j]]), use_tqdm=False)[0].outputs[0]
    assert res.finish_reason == "stop"
    assert res.stop_reason == full[j]
    assert res.token_ids == full[: j + 1], "generation ends with the stop token"

    # min_tokens masks stop tokens until that many tokens exist.
    k = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    res = llm.generate([prompt], greedy(24, stop_token_ids=[full[k]], min_tokens=k + 3), use_tqdm=False)[0].outputs[0]
    assert len(res.token_ids) >= k + 3
    assert full[k] not in res.token_ids[: k + 3]
    assert res.token_ids[:k] == full[:k]


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    prompts = random_prompts(3, VOCAB, seed=34)
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True), use_tqdm=False)
    for o in outs:
        assert o.finished
        assert len(o.outputs[0].token_ids) == 5
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].stop_reason is None


def test_eos_ends_generation_unless_ignored(tiny_llm: LLM) -> None:
    """On 12 tokens eos (id 1) comes up often at temperature 1."""
    prompts = [[3 + i % 9, 4, 5] for i in range(40)]
    sps = [SamplingParams(max_tokens=40, seed=i) for i in range(40)]
    outs = tiny_llm.generate(prompts, sps, use_tqdm=False)
    stopped = 0
    for o in outs:
        c = o.outputs[0]
        assert EOS_ID not in c.token_ids[:-1], "nothing is generated after eos"
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS_ID and c.stop_reason is None
            stopped += 1
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40
    assert stopped > 0, "no request met eos; the tiny model should emit it"

    ignored = tiny_llm.generate(
        prompts, [SamplingParams(max_tokens=40, seed=i, ignore_eos=True) for i in range(40)], use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 40 and o.outputs[0].finish_reason == "length" for o in ignored)


# --- n and logprobs -------------------------------------------------------------------------------------


def test_n_returns_indexed_samples(llm: LLM) -> None:
    prompt = random_prompts(1, VOCAB, [12], seed=35)[0]
    out = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert len(out) == 1
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out[0].outputs)
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1, "3 samples at temperature 1 all equal"


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.5])
def test_logprobs_shape_and_values(llm: LLM, tiny_llama_dir: str, temperature: float) -> None:
    prompt = random_prompts(1, VOCAB, [10], seed=36)[0]
    sp = SamplingParams(temperature=temperature, seed=5, max_tokens=6, ignore_eos=True, logprobs=3)
    c = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 6
    # The engine reports the model's own distribution, before temperature (vLLM V1's raw logprobs).
    want = torch.log_softmax(hf_logits(tiny_llama_dir, prompt + list(c.token_ids))[len(prompt) - 1 : -1], -1)
    total = 0.0
    for pos, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert token in entry
        assert len(entry) in (3, 4), "top-3 plus the sampled token when it is not among them"
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[:3] == [1, 2, 3]
        if temperature == 0.0:
            assert entry[token].rank == 1
        for t, lp in entry.items():
            assert lp.logprob <= 0.0
            assert lp.logprob == pytest.approx(want[pos, t].item(), abs=1e-4)
            assert lp.decoded_token is None or isinstance(lp.decoded_token, str)
        top3 = torch.topk(want[pos], 3).indices.tolist()
        assert {t for t, lp in entry.items() if lp.rank <= 3} == set(top3)
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_repetition_penalty_matches_transformers(llm: LLM, tiny_llama_dir: str) -> None:
    """vLLM and transformers apply repetition_penalty the same way: over prompt and output tokens."""
    prompt = random_prompts(1, VOCAB, [24], seed=37)[0]
    got = llm.generate([prompt], greedy(16, repetition_penalty=1.5), use_tqdm=False)[0].outputs[0].token_ids
    model = load_hf(tiny_llama_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
            pad_token_id=model.generation_config.pad_token_id,
        )[0, len(prompt) :].tolist()
    assert got == want


@pytest.mark.parametrize(
    "penalties",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=0.5, frequency_penalty=0.3),
    ],
    ids=["presence", "frequency", "both"],
)
def test_presence_and_frequency_penalties_match_reference(tiny_llm: LLM, tiny_vocab_dir: str, penalties: dict) -> None:
    """vLLM's (OpenAI's) rule: logit -= presence * [count > 0] + frequency * count, over output tokens only.

    Greedy on 12 tokens repeats a lot, so the penalties change the path; a step-by-step reference
    on transformers' logits gives the exact expected tokens.
    """
    prompt = [3, 4, 5]
    max_tokens = 20
    want: list[int] = []
    for _ in range(max_tokens):
        logits = hf_logits(tiny_vocab_dir, prompt + want)[-1].double()
        counts = torch.bincount(torch.tensor(want, dtype=torch.long), minlength=TINY_VOCAB).double()
        logits -= penalties.get("presence_penalty", 0.0) * (counts > 0)
        logits -= penalties.get("frequency_penalty", 0.0) * counts
        want.append(int(logits.argmax()))
    got = tiny_llm.generate([prompt], greedy(max_tokens, **penalties), use_tqdm=False)[0].outputs[0].token_ids
    plain = tiny_llm.generate([prompt], greedy(max_tokens), use_tqdm=False)[0].outputs[0].token_ids
    assert want != plain, "the penalties should change this greedy path, or the test proves nothing"
    assert got == want


def test_seeded_n_samples_reproducible_in_a_batch(llm: LLM) -> None:
    """A seeded request with n=3 gives the same three samples alone and beside other requests."""
    prompts = random_prompts(4, VOCAB, seed=38)
    sp = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=8, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate([prompts[0]], sp, use_tqdm=False)[0].outputs]
    others = [SamplingParams(n=2, temperature=1.0, max_tokens=5, ignore_eos=True)] * 3
    batched = llm.generate(prompts, [sp, *others], use_tqdm=False)
    assert [c.token_ids for c in batched[0].outputs] == alone
    assert [len(o.outputs) for o in batched] == [3, 2, 2, 2]
    assert len({tuple(t) for t in alone}) > 1, "the three samples must not share one generator state"


def test_greedy_n_samples_are_identical(llm: LLM) -> None:
    prompt = random_prompts(1, VOCAB, [21], seed=39)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    single = llm.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    assert [c.token_ids for c in out.outputs] == [single] * 3


def test_min_tokens_holds_back_eos(tiny_llm: LLM) -> None:
    """eos is frequent on 12 tokens; with min_tokens it may not end a request early."""
    prompts = [[3 + i % 9, 5, 4] for i in range(30)]
    sps = [SamplingParams(max_tokens=30, min_tokens=12, seed=i) for i in range(30)]
    outs = tiny_llm.generate(prompts, sps, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) >= 12
        assert EOS_ID not in c.token_ids[:11]
    assert any(o.outputs[0].finish_reason == "stop" for o in outs), "eos should still end some requests later"


def test_zero_logprobs_returns_only_the_chosen_token(llm: LLM) -> None:
    prompt = random_prompts(1, VOCAB, [9], seed=40)[0]
    sp = SamplingParams(temperature=1.0, seed=4, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
    assert out.prompt_logprobs[0] is None
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]


def test_min_tokens_masks_eos_even_with_ignore_eos(tiny_llama_dir: str, tmp_path) -> None:
    """vLLM counts the model's EOS ids (generation_config's list included) among the ids min_tokens masks,
    whatever ignore_eos says; transformers' generate(min_new_tokens=...) masks them the same way. With
    ignore_eos the request then runs on past the EOS where transformers stops."""
    import json
    import shutil

    prompt = random_prompts(1, VOCAB, [11], seed=41)[0]
    free = LLM(model=tiny_llama_dir, dtype="float32", seed=0, max_model_len=128).generate(
        [prompt], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    extra_eos = free[1]  # the model's second greedy token becomes a generation_config EOS id
    assert extra_eos not in free[:1] and extra_eos != EOS_ID
    model = tmp_path / "extra_eos"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [EOS_ID, extra_eos]
    (model / "generation_config.json").write_text(json.dumps(config))

    min_tokens, max_tokens = 4, 12
    hf = load_hf(model)
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                           min_new_tokens=min_tokens, max_new_tokens=max_tokens,
                           pad_token_id=config["pad_token_id"])[0, len(prompt):].tolist()
    llm = LLM(model=str(model), dtype="float32", seed=0, max_model_len=128)
    stopped, ignored = (llm.generate([prompt], SamplingParams(temperature=0.0, min_tokens=min_tokens,
                                                              max_tokens=max_tokens, ignore_eos=ignore),
                                     use_tqdm=False)[0].outputs[0].token_ids for ignore in (False, True))
    assert stopped == want
    assert extra_eos not in ignored[:min_tokens] and EOS_ID not in ignored[:min_tokens]
    assert ignored[:len(want)] == want, "ignore_eos changes only whether EOS ends the request"
    assert len(ignored) == max_tokens


def test_bf16_greedy_takes_the_argmax_of_the_float32_logits(tiny_llama_dir: str) -> None:
    """A plain-greedy step argmaxes the LM head's bf16 logits without their float32 copy; asking for
    logprobs sends the same rows through the sampler on float32 logits: the tokens must agree."""
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", max_model_len=256, seed=0)
    prompts = random_prompts(6, 200, seed=3)
    plain = llm.generate(prompts, greedy(24), use_tqdm=False)
    sampled = llm.generate(prompts, greedy(24, logprobs=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in sampled]


def test_logit_bias_shifts_the_logits_and_allowed_token_ids_restrict_them(llm: LLM, tiny_llama_dir: str) -> None:
    """logit_bias (OpenAI's) adds its biases to the logits before sampling: a -100 on the greedy token moves
    the argmax to the runner-up (the logprobs returned are the model's own, as vLLM's default
    logprobs_mode); with allowed_token_ids (vLLM's) only those tokens are ever sampled."""
    prompt = random_prompts(1, VOCAB, [9], seed=31)[0]
    logits = hf_logits(tiny_llama_dir, prompt)[-1]
    best, second = torch.topk(logits, 2).indices.tolist()
    out = llm.generate([prompt], greedy(1, logit_bias={best: -100.0}, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [second]
    want = torch.log_softmax(logits, -1)[second]
    assert out.logprobs[0][second].logprob == pytest.approx(want.item(), abs=1e-4)
    allowed = [5, 77, 300]
    outs = llm.generate([prompt] * 4, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                     allowed_token_ids=allowed), use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)


def _find(tokens: list[int], word: list[int]) -> int:
    """The index just past the first occurrence of `word` in `tokens`, or -1."""
    return next((i + len(word) for i in range(len(tokens) - len(word) + 1) if tokens[i:i + len(word)] == word), -1)


def test_bad_words_are_never_generated(llm: LLM) -> None:
    """vLLM's bad_words: a word's last token is masked wherever the output ends with the rest of it, so
    greedy decoding runs as before up to where the word would be completed, then takes another token; and
    sampling never completes it. Each word is tokenized bare and after a space."""
    prompt = random_prompts(1, VOCAB, [12], seed=35)[0]
    plain = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    word = llm.get_tokenizer().decode(plain[4:6])
    sequences = llm.llm_engine.input_processor.bad_words_token_ids([word])
    assert sequences and all(sequences)
    ends = [end for end in (_find(plain, seq) for seq in sequences) if end >= 0]
    assert ends, "the word should be among the greedy tokens for this test to say anything"
    end = min(ends)
    got = llm.generate([prompt], greedy(16, bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    assert got[:end - 1] == plain[:end - 1] and got[end - 1] != plain[end - 1]
    assert all(_find(got, seq) < 0 for seq in sequences)
    sampled = llm.generate([prompt] * 4, SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True,
                                                        bad_words=[word]), use_tqdm=False)
    assert all(_find(o.outputs[0].token_ids, seq) < 0 for o in sampled for seq in sequences)
    one_token = [seq[0] for seq in sequences if len(seq) == 1]
    for o in sampled:
        assert not set(one_token) & set(o.outputs[0].token_ids)


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm: LLM) -> None:
    prompt = random_prompts(1, VOCAB, [40], seed=33)[0]
    got = llm.generate([prompt], greedy(6, truncate_prompt_tokens=9), use_tqdm=False)[0]
    want = llm.generate([prompt[-9:]], greedy(6), use_tqdm=False)[0]
    assert got.prompt_token_ids == prompt[-9:] and got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("params,field", [
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(logprobs=2.5), "logprobs"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs"), (dict(n=True), "n"), (dict(top_k=True), "top_k"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(bad_words="no"), "bad_words"), (dict(bad_words=["ok", " "]), "bad_words")])
def test_bad_sampling_params_name_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_token_ids_past_the_vocabulary_are_refused_by_name(llm: LLM) -> None:
    for params in (dict(logit_bias={VOCAB + 10: 1.0}), dict(allowed_token_ids=[1, VOCAB])):
        with pytest.raises(ValueError, match=next(iter(params))):
            llm.generate(["hello"], SamplingParams(**params), use_tqdm=False)
