"""The offline `LLM` API a vLLM user expects (issue 3).

generate() takes every prompt form vLLM takes, one SamplingParams or one per prompt; chat() applies the
model's chat template; outputs carry vLLM's fields; metrics count what was done.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import weakref
from pathlib import Path

import pytest
from tiny_models import metric_values, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.outputs import CompletionOutput, RequestOutput

VOCAB = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TEXTS = ["def fibonacci(n):", "Hello, world! How are", "import heapq\n"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", seed=0, max_model_len=256)


def ids_of(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_str_and_list_of_str(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    one = llm.generate(TEXTS[0], GREEDY, use_tqdm=False)
    assert isinstance(one, list) and len(one) == 1
    assert one[0].prompt == TEXTS[0]
    assert one[0].prompt_token_ids == tok.encode(TEXTS[0])

    many = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in many] == TEXTS, "outputs come back in input order"
    assert [o.prompt_token_ids for o in many] == [tok.encode(t) for t in TEXTS]
    assert ids_of(many)[0] == ids_of(one)[0]
    assert len({o.request_id for o in one + many}) == 4, "request ids are unique"


def test_token_id_prompts_and_dicts(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    from_text = ids_of(llm.generate(TEXTS, GREEDY, use_tqdm=False))

    single = llm.generate(prompts[0], GREEDY, use_tqdm=False)  # one list[int] is one prompt
    assert len(single) == 1 and single[0].prompt_token_ids == prompts[0]
    assert ids_of(single)[0] == from_text[0]

    assert ids_of(llm.generate(prompts, GREEDY, use_tqdm=False)) == from_text
    as_dicts = [{"prompt_token_ids": p} for p in prompts]
    assert ids_of(llm.generate(as_dicts, GREEDY, use_tqdm=False)) == from_text
    assert ids_of(llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)) == [from_text[1]]
    text_dicts = llm.generate([{"prompt": t} for t in TEXTS], GREEDY, use_tqdm=False)
    assert ids_of(text_dicts) == from_text
    assert [o.prompt for o in text_dicts] == TEXTS
    # vLLM's prompt types, from where a vLLM script imports them
    from pagedllm import TextPrompt, TokensPrompt
    typed = [TokensPrompt(prompt_token_ids=prompts[0]), TextPrompt(prompt=TEXTS[1])]
    assert ids_of(llm.generate(typed, GREEDY, use_tqdm=False)) == from_text[:2]


def test_one_sampling_params_per_prompt(llm: LLM) -> None:
    prompts = random_prompts(3, VOCAB, seed=60)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 4, 9)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 4, 9]
    # The caller's SamplingParams are not mutated by the engine.
    assert [p.max_tokens for p in params] == [1, 4, 9]
    # Default sampling params: vLLM's defaults (16 tokens, temperature 1).
    default = llm.generate(prompts[:1], use_tqdm=False)[0].outputs[0]
    assert 1 <= len(default.token_ids) <= 16


def test_output_fields(llm: LLM) -> None:
    out = llm.generate(TEXTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput)
    for name in (
        "request_id",
        "prompt",
        "prompt_token_ids",
        "prompt_logprobs",
        "outputs",
        "finished",
        "metrics",
    ):
        assert hasattr(out, name), name
    assert out.finished is True
    assert out.prompt_logprobs is None
    (c,) = out.outputs
    assert isinstance(c, CompletionOutput)
    names = {f.name for f in dataclasses.fields(c)}
    assert {
        "index",
        "text",
        "token_ids",
        "cumulative_logprob",
        "logprobs",
        "finish_reason",
        "stop_reason",
    } <= names
    assert c.index == 0
    assert c.finish_reason == "length"
    assert c.logprobs is None  # not asked for
    assert all(isinstance(t, int) for t in c.token_ids)
    assert_text_matches_decode(llm, out)


def assert_text_matches_decode(llm: LLM, out: RequestOutput) -> None:
    """Incremental detokenization ends where decoding the whole sequence does, except that bytes of an
    unfinished UTF-8 character at the very end are held back (as vLLM's detokenizer does)."""
    tok = llm.get_tokenizer()
    for c in out.outputs:
        full = tok.decode(list(out.prompt_token_ids) + list(c.token_ids), skip_special_tokens=True)
        prompt_text = tok.decode(list(out.prompt_token_ids), skip_special_tokens=True)
        want = full[len(prompt_text) :] if full.startswith(prompt_text) else tok.decode(list(c.token_ids))
        assert c.text in (want, want.rstrip("\ufffd")), (c.text, want)


def test_incremental_detokenization_many_outputs(llm: LLM) -> None:
    """Random byte-level tokens split UTF-8 characters across tokens; the text must still come out whole."""
    prompts = random_prompts(16, VOCAB, seed=63)
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)
    for out in llm.generate(prompts, sp, use_tqdm=False):
        assert_text_matches_decode(llm, out)


def test_skip_special_tokens(tiny_vocab_dir: str) -> None:
    """On 12 tokens the specials (bos/eos/pad) are sampled often: they show only when asked for."""
    llm = LLM(model=tiny_vocab_dir, dtype="float32", max_model_len=128, seed=0)
    texts = {}
    for skip in (True, False):
        sp = SamplingParams(max_tokens=40, ignore_eos=True, seed=2, skip_special_tokens=skip)
        c = llm.generate([[3, 4, 5]], sp, use_tqdm=False)[0].outputs[0]
        assert any(t in (0, 1, 2) for t in c.token_ids), "seed 2 should sample a special token"
        texts[skip] = c.text
    assert "<|" not in texts[True]
    assert "<|" in texts[False]


def test_max_tokens_none_runs_to_max_model_len(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64)
    prompt = random_prompts(1, VOCAB, [50], seed=64)[0]
    c = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 64 - 50
    assert c.finish_reason == "length"


def test_max_tokens_past_the_context_ends_by_length_there(tiny_llama_dir: str) -> None:
    """As vLLM's LLM: a prompt plus max_tokens past max_model_len is not refused; generation stops at the
    context's end (the server still answers 400, as vLLM's does)."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64)
    prompt = random_prompts(1, VOCAB, [50], seed=65)[0]
    c = llm.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 64 - 50 and c.finish_reason == "length"
    pool = llm.llm_engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks  # (no block leaked)


def test_vllms_config_overrides_and_skip_tokenizer_init(tiny_llama_dir: str) -> None:
    """hf_overrides replaces config.json keys, override_generation_config the sampling defaults;
    skip_tokenizer_init runs on token ids alone (no text out, a text prompt refused by name)."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", hf_overrides={"max_position_embeddings": 77},
              override_generation_config={"temperature": 0.0, "top_k": 5}, max_logprobs=-1)
    assert llm.llm_engine.model_config.max_model_len == 77
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.top_k == 5
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=100), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) >= 100  # max_logprobs=-1: no limit
    whole = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)[0].outputs[0]
    assert len(whole.logprobs[0]) == llm.llm_engine.model_config.vocab_size  # -1: the whole vocabulary
    bare = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="logprobs"):  # -1 past the default max_logprobs (20)
        bare.generate([[5, 6, 7]], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    assert bare.get_tokenizer() is None
    got = bare.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                    detokenize=False), use_tqdm=False)[0].outputs[0]
    want = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == ""
    with pytest.raises(ValueError, match="prompt"):
        bare.generate("hello", use_tqdm=False)


def test_vllms_call_arguments(llm: LLM) -> None:
    """priority (zeros: there is no priority scheduling), chat's tools (given to the template) and content
    format, best_of == n, and the engine's get_tokenizer, as a vLLM script passes them."""
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    plain = ids_of(llm.generate(TEXTS[:2], GREEDY, use_tqdm=False))
    assert ids_of(llm.generate(TEXTS[:2], GREEDY, use_tqdm=False, priority=[0, 0])) == plain
    with pytest.raises(ValueError, match="priority"):
        llm.generate(TEXTS[:2], GREEDY, use_tqdm=False, priority=[1, 0])
    template = "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{{ messages[-1]['content'] }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template=template, tools=tools)
    assert out[0].prompt == "[get_weather]hi"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    listed = "{% for p in messages[-1]['content'] %}<{{ p['text'] }}>{% endfor %}"
    out = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=listed, chat_template_content_format="openai")
    assert out[0].prompt == "<a><b>"
    assert SamplingParams(n=2, best_of=2).best_of == 2
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=3)


def test_detokenize_false(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    c = llm.generate(TEXTS[1], sp, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 4
    assert c.text == ""


def test_chat_applies_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    want_ids = tok.encode(rendered, add_special_tokens=False)

    out = llm.chat(conv, GREEDY, use_tqdm=False)
    assert len(out) == 1
    assert out[0].prompt_token_ids == want_ids
    assert ids_of(out) == ids_of(llm.generate({"prompt_token_ids": want_ids}, GREEDY, use_tqdm=False))

    convs = [conv, [{"role": "user", "content": "Another one."}]]
    both = llm.chat(convs, GREEDY, use_tqdm=False)
    assert len(both) == 2 and both[0].prompt_token_ids == want_ids

    no_gen = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    rendered_no_gen = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
    assert no_gen.prompt_token_ids == tok.encode(rendered_no_gen, add_special_tokens=False)


def test_use_tqdm_false_prints_no_progress_bar(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(TEXTS, GREEDY, use_tqdm=False)
    captured = capsys.readouterr()
    assert "it/s" not in captured.err and "%|" not in captured.err


def test_metrics_count_tokens_and_requests(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", seed=0, max_model_len=256)
    before = metric_values(llm)
    for name in (
        "pagedllm:kv_cache_total_blocks",
        "pagedllm:kv_cache_free_blocks",
        "pagedllm:kv_cache_usage_perc",
        "pagedllm:num_requests_running",
        "pagedllm:num_requests_waiting",
        "pagedllm:num_preemptions",
        "pagedllm:prompt_tokens",
        "pagedllm:generation_tokens",
        "pagedllm:prefix_cache_queries",
        "pagedllm:prefix_cache_hits",
    ):
        assert name in before, name
    assert before["pagedllm:kv_cache_total_blocks"] > 0
    assert before["pagedllm:kv_cache_usage_perc"] == 0

    prompts = random_prompts(4, VOCAB, [3, 10, 20, 40], seed=61)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    after = metric_values(llm)
    assert after["pagedllm:prompt_tokens"] - before["pagedllm:prompt_tokens"] == sum(map(len, prompts))
    assert after["pagedllm:generation_tokens"] - before["pagedllm:generation_tokens"] == 7 * len(outs)
    assert after["pagedllm:kv_cache_free_blocks"] == after["pagedllm:kv_cache_total_blocks"]
    assert after["pagedllm:kv_cache_usage_perc"] == 0
    assert all(o.metrics is None or o.metrics.arrival_time > 0 for o in outs)


def test_llm_engine_and_reset_prefix_cache(llm: LLM) -> None:
    assert llm.llm_engine is not None
    prompt = random_prompts(1, VOCAB, [48], seed=62)[0]
    first = ids_of(llm.generate([prompt], GREEDY, use_tqdm=False))
    llm.reset_prefix_cache()
    assert ids_of(llm.generate([prompt], GREEDY, use_tqdm=False)) == first


def test_chat_without_template_is_a_value_error(tiny_llama_dir: str, tmp_path: Path) -> None:
    model_dir = tmp_path / "no_template"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink()
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="(?i)chat.?template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert len(llm.generate(TEXTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_spaces_between_special_tokens_as_vllm() -> None:
    """vLLM decodes a slow (Python) tokenizer's added tokens as pieces of their own, joined to the text
    around them with a space unless spaces_between_special_tokens=False; a fast tokenizer's decode is
    left as it is."""
    from transformers import PythonBackend

    from pagedllm.engine.detokenizer import IncrementalDetokenizer

    class WordTokenizer(PythonBackend):
        def __init__(self, **kwargs):
            self.vocab = {"<unk>": 0, "hello": 1, "world": 2}
            self.inverse = {i: w for w, i in self.vocab.items()}
            super().__init__(**kwargs)

        @property
        def vocab_size(self) -> int:
            return len(self.vocab)

        def get_vocab(self) -> dict[str, int]:
            return dict(self.vocab, **self.added_tokens_encoder)

        def _tokenize(self, text: str) -> list[str]:
            return text.split()

        def _convert_token_to_id(self, token: str) -> int:
            return self.vocab.get(token, 0)

        def _convert_id_to_token(self, index: int) -> str:
            return self.inverse.get(index, "<unk>")

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return "-".join(tokens)

    tokenizer = WordTokenizer(bos_token="<s>", eos_token="</s>")
    ids = tokenizer.convert_tokens_to_ids(["<s>", "hello", "world", "</s>", "</s>"])

    def text(skip: bool, spaces: bool) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, [ids[0]], skip, spaces)
        return "".join(detokenizer.add_tokens([t]) for t in ids[1:])

    assert text(False, True) == " hello-world </s> </s>"  # spaced from the prompt's <s> too
    assert text(False, False) == "hello-world</s></s>"
    assert text(True, True) == text(True, False) == "hello-world"


def _generate_noting_requests(engine_llm: LLM) -> list[weakref.ref]:
    """Generate from TEXTS (two samples each), noting every request the scheduler takes by a weak reference."""
    requests: list[weakref.ref] = []
    scheduler = engine_llm.llm_engine.scheduler

    def noted(request):  # type: ignore[no-untyped-def]
        requests.append(weakref.ref(request))
        type(scheduler).add_request(scheduler, request)

    scheduler.add_request = noted
    try:
        outs = engine_llm.generate(TEXTS, SamplingParams(max_tokens=4, n=2), use_tqdm=False)
    finally:
        del scheduler.add_request  # the class's method again
    assert len(outs) == 3 and len(requests) == 3 * 2  # the scheduler takes one request per sample
    return requests


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_start_up_heap_frozen_and_what_runs_freed_without_a_collection(tiny_llama_dir: str, spec: str | None
                                                                       ) -> None:
    """The engine hides what start-up loaded from the garbage collector (whose full collections would
    otherwise rescan torch's and the model's objects in the middle of the loop), and nothing it makes
    depends on a collection to go away: finished requests, and a dropped engine with its model runner,
    are freed by reference counting alone (a cycle among frozen objects is never freed: the engine and
    its memory would stay for the life of the process)."""
    speculative = {"ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                   "draft": dict(speculative_model=tiny_llama_dir, num_speculative_tokens=2)}.get(spec, {})
    engine_llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, **speculative)
    assert gc.get_freeze_count() > 0
    runner = weakref.ref(engine_llm.llm_engine.model_runner)
    gc.disable()
    try:
        requests = _generate_noting_requests(engine_llm)
        assert all(ref() is None for ref in requests)
        del engine_llm
        assert runner() is None
    finally:
        gc.enable()
