"""`pagedllm chat` in a real pseudo-terminal (pexpect), offline and against a running server."""

from __future__ import annotations

import os
import subprocess
import sys

import pexpect
import pytest
from test_server import RemoteServer

from pagedllm import LLM, SamplingParams

CHAT = [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat"]
FLAGS = ["--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", "--max-model-len", "256"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PAGEDLLM_LOGGING_LEVEL": "WARNING"}


def _reference_reply(model: str, messages: list[dict[str, str]], ignore_eos: bool = True) -> str:
    llm = LLM(model=model, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=ignore_eos)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_interactive_chat_keeps_history_resets_and_exits_on_ctrl_d(tiny_llama_dir):
    first = [{"role": "user", "content": "hello"}]
    expected_first = _reference_reply(tiny_llama_dir, first)
    second = [*first, {"role": "assistant", "content": expected_first}, {"role": "user", "content": "again"}]
    expected_second = _reference_reply(tiny_llama_dir, second)
    child = pexpect.spawn(CHAT[0], [*CHAT[1:], tiny_llama_dir, *FLAGS], env=ENV, encoding="utf-8", timeout=240,
                          dimensions=(40, 400))
    try:
        child.expect_exact("/reset clears the history")
        child.expect_exact("> ")
        child.sendline("hello")
        child.expect_exact("> ")  # the reply streamed, then the prompt again
        assert expected_first.replace("\n", "\r\n") in child.before
        child.sendline("again")  # a second turn sees the first in its history
        child.expect_exact("> ")
        assert expected_second.replace("\n", "\r\n") in child.before
        child.sendline("/reset")
        child.expect_exact("(history cleared)")
        child.expect_exact("> ")
        child.sendline("hello")  # after /reset the same message gets the first answer again
        child.expect_exact("> ")
        assert expected_first.replace("\n", "\r\n") in child.before
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_quick_prints_one_answer_with_the_system_prompt(tiny_llama_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    expected = _reference_reply(tiny_llama_dir, messages)
    done = subprocess.run([*CHAT, tiny_llama_dir, *FLAGS, "--system", "be brief", "--quick", "hi there"],
                          capture_output=True, text=True, env=ENV, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"


@pytest.mark.slow
def test_chat_against_a_running_server_streams_the_servers_reply(tiny_llama_dir, tmp_path):
    server = RemoteServer(tiny_llama_dir, tmp_path)
    try:
        messages = [{"role": "user", "content": "hi there"}]
        expected = _reference_reply(tiny_llama_dir, messages, ignore_eos=False)
        done = subprocess.run([*CHAT, "--url", f"{server.url}/v1", "--temperature", "0", "--max-tokens", "8",
                               "--quick", "hi there"], capture_output=True, text=True, env=ENV, timeout=240)
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected + "\n"
        child = pexpect.spawn(CHAT[0], [*CHAT[1:], "--url", f"{server.url}/v1", "--max-tokens", "4"], env=ENV,
                              encoding="utf-8", timeout=120)
        child.expect_exact("Chatting with tiny")
        child.expect_exact("> ")
        child.sendline("hello")
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        server.terminate()
