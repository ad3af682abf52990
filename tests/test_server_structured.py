"""Structured outputs through the server (issue 21): response_format, vLLM's guided_* extras and forced
tool calls, with the real `openai` client against `pagedllm serve` on the bundled demo model, streamed
and not; bad constraints are a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from test_server import RemoteServer

from pagedllm.assets import demo_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "stops": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["city", "days", "unit", "stops"],
    "additionalProperties": False,
}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
# JSON is compact by default (one space after ":" and ","); this pattern asks for no whitespace at all.
NO_WHITESPACE = {"guided_whitespace_pattern": ""}
MESSAGES = [{"role": "user", "content": "# plan a trip\nconfig = "}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    server = RemoteServer(demo_model_path(), tmp_path_factory.mktemp("structured_server"))
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def chat(client: openai.OpenAI, **kwargs: Any):
    kwargs.setdefault("max_tokens", 150)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index assembled from their deltas, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            # every chunk says something: a role, text, a tool call's part, or the end
            assert delta.role or delta.content or delta.tool_calls or choice.finish_reason, chunk
            content += choice.delta.content or ""
            indices = [delta.index for delta in choice.delta.tool_calls or []]
            assert len(indices) == len(set(indices)), chunk  # one entry per call in a chunk
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_json_object(client: openai.OpenAI, stream: bool) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        if stream:
            content, _, finish = stream_chat(client, response_format=response_format, temperature=1.0, seed=seed)
        else:
            choice = chat(client, response_format=response_format, temperature=1.0, seed=seed).choices[0]
            content, finish = choice.message.content, choice.finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)
        assert "\n" not in content
    text = client.completions.create(model="tiny", prompt="x = ", max_tokens=60, temperature=0.0,
                                     extra_body={"response_format": {"type": "json_object"}, **NO_WHITESPACE})
    assert text.choices[0].text.startswith("{")
    plain = chat(client, response_format={"type": "text"}, temperature=0.0, max_tokens=8)
    assert plain.choices[0].message.content == chat(client, temperature=0.0, max_tokens=8).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_guided_extras_on_completions_and_chat(client: openai.OpenAI, stream: bool) -> None:
    regex, choices = r"[a-z]{3}_[0-9]{2}", ["alpha", "beta", "gamma delta"]
    for seed in range(3):
        for extra, check in (({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
                             ({"guided_choice": choices}, lambda t: t in choices),
                             ({"guided_json": SCHEMA, **NO_WHITESPACE},
                              lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True)):
            kwargs = dict(model="tiny", prompt="name = ", max_tokens=150, temperature=1.0, seed=seed, extra_body=extra)
            if stream:
                text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
            else:
                text = client.completions.create(**kwargs).choices[0].text
            assert check(text), (extra, text)
            content, _, _ = stream_chat(client, extra_body=extra, temperature=1.0, seed=seed) if stream else (
                chat(client, extra_body=extra, temperature=1.0, seed=seed).choices[0].message.content, None, None)
            assert check(content), (extra, content)
    grammar = 'root ::= "n = " [1-9] [0-9]?'
    text = client.completions.create(model="tiny", prompt="x", max_tokens=10, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"n = [1-9][0-9]?", text.choices[0].text)
    # vLLM's newer spelling, one object for all of them
    text = client.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"choice": choices}})
    assert text.choices[0].text in choices


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_returns_tool_calls(client: openai.OpenAI, stream: bool) -> None:
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(2):
        kwargs = dict(tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed)
        if stream:
            content, calls, finish = stream_chat(client, **kwargs)
            assert content == "" and list(calls) == [0]
            call = calls[0]
            assert call["id"]
        else:
            choice = chat(client, **kwargs).choices[0]
            content, finish = choice.message.content, choice.finish_reason
            assert content is None and len(choice.message.tool_calls) == 1
            tool_call = choice.message.tool_calls[0]
            assert tool_call.id and tool_call.type == "function"
            call = {"name": tool_call.function.name, "arguments": tool_call.function.arguments}
        assert finish == "tool_calls"
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_picks_among_tools(client: openai.OpenAI, stream: bool) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    names = set()
    for seed in range(4):
        kwargs = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200,
                      extra_body={"parallel_tool_calls": False})
        if stream:
            _, calls, finish = stream_chat(client, **kwargs)
            calls_list = [calls[i] for i in sorted(calls)]
        else:
            choice = chat(client, **kwargs).choices[0]
            finish = choice.finish_reason
            calls_list = [{"name": c.function.name, "arguments": c.function.arguments}
                          for c in choice.message.tool_calls]
        assert finish == "tool_calls" and len(calls_list) == 1
        for call in calls_list:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
            names.add(call["name"])
    assert names <= set(schemas)
    # "none": tools are ignored, the answer is plain text
    plain = chat(client, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=8).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length"


def test_a_streamed_tool_call_sends_its_arguments_as_they_come(client: openai.OpenAI) -> None:
    """As vLLM: a listed call's id and name first, then its arguments text as it grows, so a call cut by
    max_tokens still shows what was generated of it."""
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=1,
                  extra_body={"parallel_tool_calls": False})
    _, full, finish = stream_chat(client, max_tokens=200, **kwargs)
    assert finish == "tool_calls"
    _, cut, finish = stream_chat(client, max_tokens=25, **kwargs)
    assert finish == "length" and cut[0]["name"] == full[0]["name"] and cut[0]["id"]
    assert cut[0]["arguments"] and full[0]["arguments"].startswith(cut[0]["arguments"])


def test_guided_whitespace_flexible_allows_free_whitespace(client: openai.OpenAI) -> None:
    # Seeded samples, so the same texts every run: the demo model reaches for newlines as soon as it may.
    def texts(flexible: bool | None) -> list[str]:
        extra = {"guided_json": SCHEMA} | ({} if flexible is None else {"guided_whitespace_flexible": flexible})
        return [client.completions.create(model="tiny", prompt="config = ", max_tokens=30, temperature=1.0,
                                          seed=seed, extra_body=extra).choices[0].text for seed in range(4)]

    assert not any("\n" in text for text in texts(None) + texts(False))
    assert any("\n" in text for text in texts(True))


def test_bad_constraints_are_400s_naming_the_field(server: RemoteServer) -> None:
    def post(path: str, **body: Any) -> dict:
        base = {"model": "tiny", "max_tokens": 5}
        base.update({"prompt": "x"} if path.endswith("completions") and "messages" not in body else {})
        response = server.post(path, {**base, **body})
        assert response.status_code == 400, response.text
        return response.json()["error"]

    completions, chat_path = "/v1/completions", "/v1/chat/completions"
    assert post(completions, guided_regex="(unclosed")["param"] == "guided_regex"
    # compiles, but its first token overflows the grammar library's lexer: refused, never run unconstrained
    for _ in range(2):
        error = post(completions, guided_regex="(b{1000}){1000}")
        assert error["param"] == "guided_regex" and "limits" in error["message"]
    error = post(completions, guided_json={"type": "object", "properties": {"a": {"type": "nope"}}})
    assert error["param"] == "guided_json" and "JSON schema" in error["message"]
    error = post(completions, guided_json={"not": {"type": "string"}})
    assert error["param"] == "guided_json" and "cannot be compiled" in error["message"]
    assert post(completions, guided_choice=[])["param"] == "guided_choice"
    assert post(completions, structured_outputs={"choise": ["a"]})["param"] == "structured_outputs"
    assert post(completions, structured_outputs={"regex": "a", "choice": ["b"]})["param"] == "structured_outputs"
    assert post(completions, structured_outputs={"regex": "a"}, guided_choice=["b"])["param"] == "structured_outputs"
    assert post(completions, guided_regex="a", guided_choice=["b"])["param"] == "guided_choice"
    assert post(completions, response_format={"type": "json_schema", "json_schema": {"name": "x"}})["param"] \
        == "response_format"
    error = post(chat_path, messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": "oops"}}})
    assert error["param"] == "response_format"
    error = post(chat_path, messages=MESSAGES, tools=TOOLS, tool_choice="auto")
    assert error["param"] == "tool_choice" and "auto" in error["message"]
    assert post(chat_path, messages=MESSAGES, tools=TOOLS)["param"] == "tool_choice"  # the default is auto
    assert post(chat_path, messages=MESSAGES, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "missing"}})["param"] == "tool_choice"
    assert post(chat_path, messages=MESSAGES, tool_choice="required")["param"] == "tool_choice"
    assert post(chat_path, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                guided_regex="a")["param"] == "guided_regex"
    assert post(completions, guided_whitespace_flexible=True)["param"] == "guided_whitespace_flexible"
    assert post(completions, guided_json=SCHEMA, guided_whitespace_flexible="maybe")["param"] \
        == "guided_whitespace_flexible"
    server.assert_healthy()


def test_tools_and_tool_turns_reach_the_chat_template() -> None:
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving_chat import render_chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    tokenizer.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments }}){% endfor %}"
        "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}
    request = ChatCompletionRequest(model="tiny", tools=TOOLS, tool_choice="required", messages=[
        {"role": "user", "content": "time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}])
    text = render_chat_prompt(tokenizer, request.messages, False, None,
                              [tool.model_dump() for tool in request.tools])
    assert text == ('[tool get_weather][tool get_time]<user>time?<assistant>(call get_time {"zone":"UTC"})'
                    "<tool>12:00(for call_1)")
