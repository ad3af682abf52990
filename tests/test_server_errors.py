"""Every error case of the OpenAI-compatible server answers its status with an OpenAI-shaped body
(`{"error": {"message", "type", "param", "code"}}`), and the server still answers /health afterwards.

One server with an API key, a 64 KiB body limit, one running sequence and room for one waiting request.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import RemoteServer

API_KEY = "test-secret-key"
MAX_MODEL_LEN = 4096  # a request to the full length runs for seconds: long enough to hang up during it
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama_dir, tmp_path_factory.mktemp("server_errors_logs"), api_key=API_KEY,
                          extra_args=["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1",
                                      "--max-waiting-requests", "1", "--max-request-body-bytes",
                                      str(BODY_LIMIT)])
    yield remote
    assert remote.terminate() == 0, remote.log()


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- 400: invalid parameters, over-long prompts, malformed bodies --------------------------------

COMPLETION_CASES = [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": 2 ** 70}, "seed"),
    ({"seed": -(2 ** 64)}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [10 ** 7]}, "prompt"),
    ({"prompt": {"not": "a prompt"}}, "prompt"),
    ({"prompt": [5] * (MAX_MODEL_LEN + 10)}, "prompt"),
    ({"prompt": [5] * 10, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"suffix": "tail"}, "suffix"),
]


@pytest.mark.parametrize(("fields", "param"), COMPLETION_CASES)
def test_completion_bad_parameters(server: RemoteServer, fields: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **fields}
    assert_error(server.post("/v1/completions", body), 400, param)
    server.assert_healthy()


def test_completion_missing_prompt(server: RemoteServer) -> None:
    assert_error(server.post("/v1/completions", {"model": "tiny"}), 400, "prompt")


def test_logprobs_beyond_vocabulary(server: RemoteServer) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "logprobs": 10 ** 6}
    error = assert_error(server.post("/v1/completions", body), 400)
    assert error["param"] in ("logprobs", None)
    server.assert_healthy()


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"temperature": -2}, "temperature"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 500)}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"logit_bias": {"3": 500}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"use_beam_search": True}, "use_beam_search"),  # vLLM's: not sampled instead, without a word
    ({"priority": 5}, "priority"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_CASES)
def test_chat_bad_parameters(server: RemoteServer, fields: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    assert_error(server.post("/v1/chat/completions", body), 400, param)
    server.assert_healthy()


@pytest.mark.parametrize("content", [b'{"prompt": "hi", ', b"not json at all", b"[1, 2, 3]", b'"a string"',
                                     b"\xff\xfe\x00garbage", b""])
def test_malformed_json(server: RemoteServer, content: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{server.url}{path}", content=content, timeout=30.0,
                              headers={**server.headers(), "Content-Type": "application/json"})
        assert_error(response, 400)
    server.assert_healthy()


def test_openai_client_raises_bad_request(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model="tiny", prompt="hi", temperature=-1.0)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"


# ---- 401, 404, 413 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_api_key_required(server: RemoteServer, headers: dict[str, str]) -> None:
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                               ("POST", "/v1/chat/completions", chat),
                               ("POST", "/tokenize", {"prompt": "hi"})]:
        response = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30.0)
        assert_error(response, 401)
    for path in ("/health", "/metrics", "/version"):  # open to probes and scrapers
        assert httpx.get(f"{server.url}{path}", headers=headers, timeout=30.0).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert server.get("/v1/models").status_code == 200  # the right key still works
    server.assert_healthy()


def test_unknown_model(server: RemoteServer) -> None:
    assert_error(server.post("/v1/completions", {"model": "gpt-17", "prompt": "hi"}), 404, "model")
    assert_error(server.post("/v1/chat/completions", {"model": "gpt-17", "messages": [
        {"role": "user", "content": "hi"}]}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-17", prompt="hi")
    assert_error(server.get("/v1/no-such-route"), 404)
    server.assert_healthy()


def test_oversized_body(server: RemoteServer) -> None:
    body = {"model": "tiny", "prompt": "x" * (2 * BODY_LIMIT)}
    assert_error(server.post("/v1/completions", body), 413)
    # without a Content-Length header (chunked upload) the limit still holds
    raw = json.dumps(body).encode()
    chunks = iter([raw[i:i + 8192] for i in range(0, len(raw), 8192)])
    response = httpx.post(f"{server.url}/v1/completions", content=chunks, timeout=30.0,
                          headers={**server.headers(), "Content-Type": "application/json"})
    assert_error(response, 413)
    server.assert_healthy()


# ---- 503: the waiting queue is full --------------------------------------------------------------

def test_waiting_queue_full(server: RemoteServer) -> None:
    """One sequence runs, one waits (max_num_seqs=1, --max-waiting-requests 1): a third gets 503."""
    long_body = {"model": "tiny", "prompt": "hello", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True,
                 "stream": True, "temperature": 0}
    streaming, hang_up = threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def hold_running() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long_body, headers=server.headers(),
                          timeout=120.0) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    streaming.set()
                if hang_up.is_set():
                    break  # leaving the stream aborts the request

    def run_waiting() -> None:
        body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
        results["waiting"] = server.post("/v1/completions", body)

    running = threading.Thread(target=hold_running)
    running.start()
    waiting = threading.Thread(target=run_waiting)
    try:
        assert streaming.wait(120.0)
        waiting.start()
        deadline = time.monotonic() + 60.0
        while server.metrics().get("pagedllm:num_requests_waiting", 0) < 1:
            assert time.monotonic() < deadline, "the second request never showed up as waiting"
        error = assert_error(server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3}), 503)
        assert error["type"] == "ServiceUnavailable"
    finally:
        hang_up.set()
        running.join(120.0)
        if waiting.is_alive() or "waiting" in results:
            waiting.join(120.0)
    assert results["waiting"].status_code == 200, results["waiting"].text
    server.assert_healthy()


# ---- no input takes the server down ----------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children,
                                                                       max_size=4),
    max_leaves=12)
field_names = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n",
                               "logprobs", "stop", "seed", "stream", "echo", "min_p", "stop_token_ids",
                               "min_tokens", "presence_penalty", "stream_options", "top_logprobs", "model"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       body=st.dictionaries(field_names, json_values, max_size=6))
def test_fuzzed_bodies_never_500(server: RemoteServer, path: str, body: dict[str, Any]) -> None:
    if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep valid requests short
    body.pop("stream", None)
    body["n"] = body["n"] if isinstance(body.get("n"), int) and body["n"] < 3 else 1
    response = server.post(path, body)
    assert response.status_code < 500 or response.status_code == 503, response.text
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    server.assert_healthy()


# ---- a client that hangs up has its request aborted --------------------------------------------------

def abort_count(server: RemoteServer) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("pagedllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_non_streaming_client_disconnect_aborts(server: RemoteServer) -> None:
    before = abort_count(server)
    server.post_and_hang_up("/v1/completions", {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 16,
                                                "ignore_eos": True, "temperature": 0})
    deadline = time.monotonic() + 60.0
    while abort_count(server) < before + 1:
        assert time.monotonic() < deadline, "the abandoned request was never aborted"
    metrics = server.metrics()
    assert metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:kv_cache_usage_perc"] == 0.0
    server.assert_healthy()
