"""Constraint specs -> llguidance grammars: validation without a tokenizer, compilation with one.

llguidance: it compiled schemas and built token masks fastest of the three libraries compared (with
xgrammar and outlines-core; docs/performance/index.md), installs without pulling triton (xgrammar's
wheel depends on it), reads Lark and GBNF grammars, and its parser runs on bounded "fuel" per step, so
no schema or regex can make a step hang.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

# A spec longer than this is refused before any parsing (the library's own limits bound the work per
# grammar and per step; this bounds the time one request can ask for up front).
MAX_SPEC_CHARS = 64 * 1024
# The grammar library's resource bounds: its defaults, except the fuel for building the lexer, cut
# tenfold so a pathological pattern ("(a{1000}){1000}") fails fast while ordinary schemas stay far
# below it. Per-step lexer fuel and Earley items bound every later step.
PARSER_LIMITS = dict(initial_lexer_fuel=100_000, step_lexer_fuel=200_000, step_max_items=50_000,
                     max_grammar_size=500_000)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def _json_schema_problem(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not a JSON schema, if jsonschema (optional here) can tell."""
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message
    return None


# JSON's default layout between tokens: one space after ":" and ",", nothing else (json.dumps' layout).
# Free whitespace (JSON's grammar: any run of spaces, tabs and newlines) lets a sampled small model
# wander: on the demo model at temperature 1, 4 of 20 outputs of a small schema validated with it, the
# rest filled max_tokens with indentation; 20 of 20 with this layout.
COMPACT_SEPARATORS = {"item_separator": ", ", "key_separator": ": "}


def json_whitespace_options(disable_any_whitespace: bool, whitespace_flexible: bool,
                            whitespace_pattern: str | None) -> dict[str, Any]:
    """llguidance's JSON options for one whitespace choice: none at all, a given pattern between tokens,
    JSON's free whitespace, or (the default) the compact layout."""
    if disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    if whitespace_flexible:
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False, **COMPACT_SEPARATORS}


# keywords whose value maps names to schemas; keywords whose value is data, never a schema
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))


def closed_objects(schema: Any, close: bool = True) -> Any:
    """The schema with `additionalProperties: false` on every object that declares properties and says
    nothing about others, as vLLM's strict default: a model writes the keys the schema names, never an
    invented one (JSON Schema's own default would allow any). An object with no declared properties stays
    open, and so do allOf's parts (closed alone, each would refuse the others' keys)."""
    if isinstance(schema, list):
        return [closed_objects(item, close) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            closed[key] = value  # (an object there is a value the output must equal, left as written)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}  # name -> schema
        else:
            closed[key] = closed_objects(value, key != "allOf")
    if (close and ("properties" in closed or "patternProperties" in closed) and "additionalProperties" not in closed
            and "unevaluatedProperties" not in closed):
        closed["additionalProperties"] = False
    return closed


@functools.lru_cache(maxsize=256)
def grammar_definition(kind: str, spec: str, disable_any_whitespace: bool = False,
                       whitespace_flexible: bool = False, whitespace_pattern: str | None = None) -> str:
    """The llguidance grammar for one constraint (GuidedDecodingParams.compile_key)."""
    options = json_whitespace_options(disable_any_whitespace, whitespace_flexible, whitespace_pattern)
    if kind in ("json", "json_object"):
        schema = closed_objects(json.loads(spec)) if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    if kind == "grammar":
        # Lark as llguidance reads it; GBNF/EBNF (llama.cpp's and xgrammar's "::=" rules) is converted.
        return llguidance.grammar_from("gbnf" if "::=" in spec else "lark", spec)
    raise AssertionError(f"unknown guided decoding kind {kind!r}")


@functools.lru_cache(maxsize=256)
def validate_spec(kind: str, spec: str, disable_any_whitespace: bool = False,
                  whitespace_flexible: bool = False, whitespace_pattern: str | None = None) -> None:
    """ValueError naming the field if the constraint is malformed or the grammar library cannot compile it."""
    field = kind
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{field} is {len(spec)} characters; at most {MAX_SPEC_CHARS} are accepted.")
    if kind == "json":
        problem = _json_schema_problem(json.loads(spec))
        if problem is not None:
            raise ValueError(f"json is not a valid JSON schema: {problem}")
    try:
        grammar = grammar_definition(kind, spec, disable_any_whitespace, whitespace_flexible, whitespace_pattern)
    except ValueError as exc:
        raise ValueError(f"{field} could not be read: {exc}") from exc
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        if kind == "json":
            raise ValueError(f"json schema cannot be compiled by the grammar library (llguidance): {error.strip()}")
        what = {"regex": "regex is invalid", "grammar": "grammar is invalid",
                "choice": "choice cannot be compiled"}.get(kind, f"{kind} cannot be compiled")
        raise ValueError(f"{what}: {error.strip()}")


class RequestGrammar:
    """One request's matcher, advanced on the tokens the request accepted (its output tokens)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.num_processed_tokens = 0
        self.failed = False  # a token the grammar refused was accepted: stop constraining, never crash

    def sync(self, output_token_ids: list[int]) -> None:
        new = output_token_ids[self.num_processed_tokens:]
        self.num_processed_tokens = len(output_token_ids)
        if self.failed:
            return
        for token in new:
            if self.matcher.is_stopped():
                # Complete: only EOS can follow, and it repeats while min_tokens (or ignore_eos) keeps the
                # request running; the text stays the complete match.
                continue
            if not self.matcher.consume_token(token):
                self.failed = True
                return

    def fill(self, bitmask: Any, row: int, draft_token_ids: list[int]) -> None:
        """Rows row..row+len(drafts): the allowed tokens at the current position and after each draft
        token the grammar accepts; rows after a draft it refuses stay all-ones (that draft is rejected
        by its masked row, so the later rows are never used)."""
        if self.failed:
            return
        width = bitmask.shape[1] * 4
        self.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), width)
        consumed = 0
        for i, token in enumerate(draft_token_ids):
            if self.matcher.is_stopped() or self.matcher.validate_tokens([token]) != 1:
                break
            self.matcher.consume_token(token)
            consumed += 1
            self.matcher.unsafe_compute_mask_ptr(bitmask[row + i + 1].data_ptr(), width)
        if consumed:
            self.matcher.rollback(consumed)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()
