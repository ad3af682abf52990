"""The server's parsers of a model's own text (vLLM's): tool_choice "auto" (--enable-auto-tool-choice
--tool-call-parser hermes), the calls a model writes, read whole and streamed (through the server, a regex
constraint makes the demo model write one); --reasoning-parser, its thinking apart as reasoning_content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_server import RemoteServer
from test_server_structured import MESSAGES, TOOLS, stream_chat

from pagedllm.assets import demo_model_path
from pagedllm.entrypoints.openai.tool_parsers import AutoToolStream, parse_tool_calls

REPLY = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
         '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')


def test_hermes_calls_are_read_from_a_finished_reply() -> None:
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me check. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
    assert parse_tool_calls("just text <tool") == ("just text <tool", [])
    broken = 'x <tool_call>{"name": "get_weather", "arguments": </tool_call>'
    assert parse_tool_calls(broken) == (broken, [])  # as vLLM: a call that does not parse leaves the text


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_calls_equal_the_finished_reply_however_the_text_arrives(step: int) -> None:
    stream, content, calls = AutoToolStream(), "", []
    pieces = [REPLY[i:i + step] for i in range(0, len(REPLY), step)]
    for i, piece in enumerate(pieces):
        more, deltas = stream.add(piece, final=i == len(pieces) - 1)
        assert "<" not in more  # a possible tag is held back, never sent as content
        content += more
        calls += deltas
    want_content, want_calls = parse_tool_calls(REPLY)
    assert content == want_content and [d.index for d in calls] == [0, 1]
    assert [(d.function.name, d.function.arguments) for d in calls] == \
        [(c.function.name, c.function.arguments) for c in want_calls]
    # text that only looked like a tag's start is sent once it is known not to be one
    stream = AutoToolStream()
    assert stream.add("a <to")[0] == "a " and stream.add("y> b", final=True)[0] == "<toy> b"


@pytest.fixture(scope="module")
def auto_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    server = RemoteServer(demo_model_path(), tmp_path_factory.mktemp("auto_tools"),
                          extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--response-role", "agent"])
    yield server.client()
    server.terminate()


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_returns_the_calls_the_model_writes(auto_client: openai.OpenAI, stream: bool) -> None:
    # the demo model does not call tools of its own accord: a regex makes it write a reply with one call
    regex = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": [1-9]\}\}</tool_call>'
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=80, extra_body={"guided_regex": regex})
    if stream:
        content, calls, finish = stream_chat(auto_client, **{k: v for k, v in kwargs.items()
                                                             if k not in ("model", "messages")})
        names = [calls[i]["name"] for i in sorted(calls)]
        arguments = [json.loads(calls[i]["arguments"]) for i in sorted(calls)]
    else:
        choice = auto_client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        names = [c.function.name for c in choice.message.tool_calls]
        arguments = [json.loads(c.function.arguments) for c in choice.message.tool_calls]
    assert content == "Sure. " and finish == "tool_calls" and names == ["get_weather"]
    assert arguments[0]["city"] == "Oslo"
    # no call in the text: a plain reply
    plain = auto_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=6,
                                                temperature=0.0).choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    assert plain.message.role == "agent"  # --response-role
    first = next(iter(auto_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True)))
    assert first.choices[0].delta.role == "agent"


def test_auto_needs_the_server_flag_and_the_flag_a_parser(tmp_path: Path) -> None:
    from test_cli import assert_one_line_error, cli

    assert_one_line_error(cli("serve", demo_model_path(), "--enable-auto-tool-choice"), "--tool-call-parser")


# ---- --reasoning-parser -------------------------------------------------------------------------------

THOUGHT = "<think>\nThe user wants weather. Check Oslo.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_is_split_from_the_reply_whole_and_streamed(parser: str) -> None:
    from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning

    assert split_reasoning(parser, THOUGHT) == ("\nThe user wants weather. Check Oslo.\n", "\n\nIt is sunny.")
    # no opening tag: deepseek_r1's replies start thinking; qwen3's are content unless they open the tag
    assert split_reasoning(parser, "plan</think>answer") == (("plan", "answer") if parser == "deepseek_r1"
                                                             else (None, "plan</think>answer"))
    assert split_reasoning(parser, "no tags") == (("no tags", None) if parser == "deepseek_r1" else (None, "no tags"))
    for step in (1, 2, 5, 100):
        stream, thought, content = ReasoningStream(parser), "", ""
        pieces = [THOUGHT[i:i + step] for i in range(0, len(THOUGHT), step)]
        for i, piece in enumerate(pieces):
            more_thought, more_content = stream.add(piece, final=i == len(pieces) - 1)
            assert "<" not in more_thought + more_content  # a tag is never shown, whole or in part
            thought, content = thought + more_thought, content + more_content
        assert (thought, content) == split_reasoning(parser, THOUGHT)


@pytest.mark.parametrize("parser,stream", [("deepseek_r1", False), ("deepseek_r1", True), ("qwen3", True)])
def test_the_server_returns_reasoning_content(tmp_path_factory: pytest.TempPathFactory, parser: str,
                                              stream: bool) -> None:
    """The demo model writes no tags: deepseek_r1 reads its whole reply as reasoning (it never closed
    </think>), qwen3 as content."""
    server = RemoteServer(demo_model_path(), tmp_path_factory.mktemp("reasoning"),
                          extra_args=["--reasoning-parser", parser])
    try:
        client = server.client()
        kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0)
        if stream:
            thought = content = ""
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    thought += getattr(choice.delta, "reasoning_content", None) or ""
                    content += choice.delta.content or ""
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            thought, content = getattr(message, "reasoning_content", None) or "", message.content or ""
        assert (thought if parser == "deepseek_r1" else content) and not (content if parser == "deepseek_r1"
                                                                            else thought)
    finally:
        server.terminate()
