"""Structured outputs (issue 21): JSON schema, regex, choice and grammar constraints on the engine.

On the bundled demo model (byte-level BPE, 8,192 tokens): every output under a constraint is valid,
constrained and unconstrained requests share batches without changing each other, and the constraint
composes with parallel sampling, preemption and speculative decoding (greedy outputs token for token
equal to constrained decoding without speculation).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm import LLM, GuidedDecodingParams, SamplingParams
from pagedllm.assets import demo_draft_path, demo_model_path
from pagedllm.layers.sampler import TokenBitmask, apply_token_bitmask
from pagedllm.structured_output.grammar import MAX_SPEC_CHARS

# Bounded on purpose (maxLength, enums, maxItems, numeric ranges): a schema that allows unbounded
# strings or digits lets a model at temperature 1 wander until max_tokens, and the test asserts that
# every output is finished and valid.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"], "additionalProperties": False}},
    },
    "required": ["name", "age", "score", "role", "address", "tags", "items"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}(\.[0-9])?"
CHOICES = ["red", "green", "blue", "light blue"]
PROMPTS = [f"# record {i}\nvalue = " for i in range(50)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=demo_model_path(), dtype="float32", seed=0)


def compact_json(schema: dict = SCHEMA) -> GuidedDecodingParams:
    return GuidedDecodingParams(json=schema, disable_any_whitespace=True)


def texts(llm: LLM, prompts: list, params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def all_outputs(outputs) -> list:
    return [completion for output in outputs for completion in output.outputs]


# --- parameters -----------------------------------------------------------------------------------------


def test_guided_decoding_params_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="^json is not a valid JSON schema"):
        GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(ValueError, match="^json is not valid JSON"):
        GuidedDecodingParams(json="{not json")
    with pytest.raises(ValueError, match="^json schema cannot be compiled by the grammar library"):
        GuidedDecodingParams(json={"not": {"type": "string"}})  # valid JSON schema, unsupported keyword
    with pytest.raises(ValueError, match="^regex is invalid"):
        GuidedDecodingParams(regex="(unclosed")
    with pytest.raises(ValueError, match="^grammar is invalid"):
        GuidedDecodingParams(grammar="start: undefined_rule")
    with pytest.raises(ValueError, match="^choice must be a non-empty list"):
        GuidedDecodingParams(choice=[])
    with pytest.raises(ValueError, match="^backend must be one of"):
        GuidedDecodingParams(regex="a", backend="xgrammar")
    with pytest.raises(ValueError, match=f"at most {MAX_SPEC_CHARS}"):
        GuidedDecodingParams(regex="a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(ValueError, match="^guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"json": SCHEMA})  # type: ignore[arg-type]
    assert GuidedDecodingParams.from_optional() is None
    params = GuidedDecodingParams(json=json.dumps(SCHEMA))
    assert params.kind == "json" and params.json == SCHEMA
    assert GuidedDecodingParams(json_object=True).kind == "json_object"

    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    assert GuidedDecodingParams(json=Point).json == Point.model_json_schema()


def test_structured_outputs_is_vllms_newer_name_for_guided_decoding(llm: LLM) -> None:
    from pagedllm import StructuredOutputsParams

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert params.guided_decoding is params.structured_outputs
    assert texts(llm, ["colour = "], params)[0] in CHOICES
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"),
                       structured_outputs=StructuredOutputsParams(regex="b"))


def test_engine_refuses_guided_decoding_without_a_tokenizer(llm: LLM) -> None:
    engine = llm.llm_engine
    tokenizer, engine.tokenizer = engine.tokenizer, None
    try:
        with pytest.raises(ValueError, match="^guided_decoding needs the model's tokenizer"):
            engine.add_request("no-tok", [5, 6, 7], SamplingParams(guided_decoding=GuidedDecodingParams(regex="a")))
    finally:
        engine.tokenizer = tokenizer


# --- outputs are valid --------------------------------------------------------------------------------------


def test_every_json_output_validates_at_temperature_1(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=250, guided_decoding=compact_json())
    outputs = all_outputs(llm.generate(PROMPTS, params, use_tqdm=False))
    assert len(outputs) == 50
    for completion in outputs:
        assert completion.finish_reason == "stop", completion.text  # EOS once the object is closed
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len({c.text for c in outputs}) > 40  # sampled, not one forced answer


def test_flexible_whitespace_json_validates(llm: LLM) -> None:
    guided = GuidedDecodingParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    params = SamplingParams(temperature=1.0, max_tokens=300, seed=5, guided_decoding=guided)
    for completion in all_outputs(llm.generate(PROMPTS[:10], params, use_tqdm=False)):
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_a_schema_that_says_nothing_of_other_keys_gets_only_its_own(llm: LLM) -> None:
    """As vLLM's strict default: an object that declares properties and says nothing of others takes no
    invented key (JSON Schema alone would allow any); allOf's parts are closed together, not each."""
    from pagedllm.structured_output.grammar import closed_objects

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                             guided_decoding=GuidedDecodingParams(json=schema)) for i in range(12)]
    for completion in all_outputs(llm.generate(["config = "] * 12, params, use_tqdm=False)):
        value = json.loads(completion.text)
        assert set(value) <= {"n", "inner"} and set(value.get("inner", {})) <= {"ok"}, completion.text
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(both) == both
    named = {"type": "object", "properties": {"properties": {"type": "string"}}}  # a key named "properties"
    assert closed_objects(named) == {**named, "additionalProperties": False}
    value = {"const": {"properties": {"a": 1}}, "enum": [{"properties": {}}]}  # data, not schemas
    assert closed_objects(value) == value


# Issue 48's schema: a bounded string, an integer, an enum array, a boolean, a closed object.
SMALL_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "count", "tags", "active"], "additionalProperties": False}


def json_layout(text: str) -> str:
    """The JSON text with every string literal emptied: what is left is its structure and whitespace."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def test_json_is_compact_by_default_so_sampled_outputs_close(llm: LLM) -> None:
    # With JSON's free whitespace, most of these 20 sampled requests indent until max_tokens.
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                             guided_decoding=GuidedDecodingParams(json=SMALL_SCHEMA)) for i in range(20)]
    outputs = all_outputs(llm.generate(["config = "] * 20, params, use_tqdm=False))
    for completion in outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SMALL_SCHEMA)
        layout = json_layout(completion.text)
        assert all(char == " " and layout[i - 1] in ":," for i, char in enumerate(layout) if char.isspace()), \
            completion.text  # one space after ":" and ",", nothing else
    assert len({c.text for c in outputs}) > 15


def test_json_whitespace_options_choose_the_layout(llm: LLM) -> None:
    manager = llm.llm_engine.structured_output_manager
    tokenizer = llm.get_tokenizer()
    layouts = {"compact": '{"name": "a", "count": 1, "tags": ["red", "blue"], "active": true}',
               "none": '{"name":"a","count":1,"tags":["red","blue"],"active":true}',
               "indented": '{\n  "name": "a",\n  "count": 1,\n  "tags": [\n    "red"\n  ],\n  "active": true\n}'}
    accepted = {"default": {"compact"}, "disable_any_whitespace": {"none"},
                "whitespace_flexible": {"compact", "none", "indented"}, "whitespace_pattern": {"compact", "none"}}
    options = {"default": {}, "disable_any_whitespace": {"disable_any_whitespace": True},
               "whitespace_flexible": {"whitespace_flexible": True},
               "whitespace_pattern": {"whitespace_pattern": r"[ ]?"}}
    for name, option in options.items():
        for kind in ("json", "json_object"):
            spec = {"json": SMALL_SCHEMA} if kind == "json" else {"json_object": True}
            matcher = manager.compile(GuidedDecodingParams(**spec, **option)).deep_copy()
            for layout, text in layouts.items():
                token_ids = tokenizer.encode(text, add_special_tokens=False)
                fits = matcher.validate_tokens(token_ids) == len(token_ids)
                assert fits == (layout in accepted[name]), (name, kind, layout)
    with pytest.raises(ValueError, match="^disable_any_whitespace allows no whitespace, so whitespace_flexible"):
        GuidedDecodingParams(json=SMALL_SCHEMA, disable_any_whitespace=True, whitespace_flexible=True)
    with pytest.raises(ValueError, match="^disable_any_whitespace allows no whitespace, so whitespace_pattern"):
        GuidedDecodingParams(json=SMALL_SCHEMA, disable_any_whitespace=True, whitespace_pattern=" ")
    with pytest.raises(ValueError, match="^whitespace_flexible must be a bool"):
        GuidedDecodingParams(json=SMALL_SCHEMA, whitespace_flexible="yes")  # type: ignore[arg-type]


def test_regex_choice_grammar_and_json_object_outputs_match(llm: LLM) -> None:
    prompts = PROMPTS[:20]
    sample = dict(temperature=1.0, max_tokens=40)
    for text in texts(llm, prompts, SamplingParams(**sample, guided_decoding=GuidedDecodingParams(regex=REGEX))):
        assert re.fullmatch(REGEX, text), text
    for text in texts(llm, prompts, SamplingParams(**sample, guided_decoding=GuidedDecodingParams(choice=CHOICES))):
        assert text in CHOICES
    lark = 'start: "x = " NUMBER ";"\nNUMBER: /[1-9][0-9]{0,3}/'
    gbnf = 'root ::= "x = " [1-9] [0-9]? [0-9]? ";"'
    for grammar in (lark, gbnf):
        for text in texts(llm, prompts[:8], SamplingParams(**sample, guided_decoding=GuidedDecodingParams(
                grammar=grammar))):
            assert re.fullmatch(r"x = [1-9][0-9]{0,3};", text), text
    # Any object: keys are unbounded, so a model may run to max_tokens; what finishes is an object.
    any_object = GuidedDecodingParams(json_object=True, disable_any_whitespace=True)
    outputs = all_outputs(llm.generate(prompts, SamplingParams(**sample, guided_decoding=any_object),
                                       use_tqdm=False))
    for completion in outputs:
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)


def test_a_complete_grammar_ends_even_before_min_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                            guided_decoding=GuidedDecodingParams(regex="ab"))
    completion = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    # EOS is the only token the grammar allows once complete, so it repeats until min_tokens lets it stop
    assert completion.text == "ab" and completion.finish_reason == "stop" and len(completion.token_ids) == 10


def test_composes_with_every_sampling_parameter_and_parallel_sampling(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.1, logprobs=2, seed=11, max_tokens=250,
                            guided_decoding=compact_json())
    outputs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for output in outputs:
        assert len(output.outputs) == 4
        for completion in output.outputs:  # each sibling follows its own matcher
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), SCHEMA)
            assert len(completion.logprobs) == len(completion.token_ids)
    assert not llm.llm_engine.structured_output_manager.grammars  # every matcher freed
    scheduler = llm.llm_engine.scheduler  # and the ids that make plans look for grammars
    assert not scheduler.guided_ids


# --- batches, preemption, speculation -----------------------------------------------------------------------


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], plain, use_tqdm=False)]
    guided = [SamplingParams(temperature=0.0, max_tokens=200, guided_decoding=compact_json()),
              SamplingParams(temperature=0.0, max_tokens=24, guided_decoding=GuidedDecodingParams(regex=REGEX))]
    mixed = llm.generate(PROMPTS[:4] + PROMPTS[10:14], [plain] * 4 + guided * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    alone_guided = llm.generate(PROMPTS[10:14], guided * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[4:]] == [o.outputs[0].token_ids for o in alone_guided]


def test_preemption_keeps_the_grammar(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, guided_decoding=compact_json())
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], params, use_tqdm=False)]
    small = LLM(model=demo_model_path(), dtype="float32", seed=0, block_size=4, num_gpu_blocks_override=64,
                max_num_batched_tokens=64, max_model_len=256)
    outputs = small.generate(PROMPTS[:6], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    metrics = {m.name: m.value for m in small.get_metrics() if not m.labels}
    assert metrics["pagedllm:num_preemptions"] > 0
    kv = small.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not small.llm_engine.structured_output_manager.grammars


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3}},
    {"speculative_model": demo_draft_path(), "num_speculative_tokens": 3},
], ids=["ngram", "draft_model"])
def test_speculative_decoding_under_a_grammar(llm: LLM, spec: dict) -> None:
    spec_llm = LLM(model=demo_model_path(), dtype="float32", seed=0, **spec)
    greedy = SamplingParams(temperature=0.0, max_tokens=200, guided_decoding=compact_json())
    regex = SamplingParams(temperature=0.0, max_tokens=30, guided_decoding=GuidedDecodingParams(regex=REGEX))
    prompts = PROMPTS[:6]
    params = [greedy, regex] * 3
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)] == want
    sampled = SamplingParams(temperature=1.0, max_tokens=250, seed=7, guided_decoding=compact_json())
    for completion in all_outputs(spec_llm.generate(PROMPTS[:6], sampled, use_tqdm=False)):
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    metrics = {m.name: m.value for m in spec_llm.get_metrics() if not m.labels}
    assert metrics["pagedllm:spec_decode_num_draft_tokens"] > 0
    assert not spec_llm.llm_engine.structured_output_manager.grammars


# --- the pieces ------------------------------------------------------------------------------------------


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    manager = llm.llm_engine.structured_output_manager
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]}
    before = manager.num_compiles
    params = SamplingParams(temperature=0.0, max_tokens=30, guided_decoding=compact_json(schema))
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    llm.generate(PROMPTS[3:5], params, use_tqdm=False)
    assert manager.num_compiles == before + 1


def test_unconstrained_steps_build_no_bitmask(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("plain", PROMPTS[0], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        scheduler_output = engine.scheduler.schedule()
        assert scheduler_output.grammar_bitmask is None
        model_output = engine.model_executor.execute_model(scheduler_output)
        engine.scheduler.update(scheduler_output, model_output)
    engine.abort_request("plain")  # its output was never read: drop it from the output processor


def test_bitmask_masks_only_its_rows() -> None:
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 5       # token 37
    bitmask[0, 2] = 1 << 1       # token 65
    original = logits.clone()
    apply_token_bitmask(logits, TokenBitmask(bitmask, [1]))
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [37, 65]
