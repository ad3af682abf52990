"""One request never harms another (issue 22): hostile input, bursts and slow clients against the
real `pagedllm serve`, over real sockets and with the openai client.

Each numbered case of the issue has a regression test here. One server serves most of them: small
read and write timeouts (so stalled sockets are dealt with in seconds), 64 waiting sequences at most.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import RemoteServer
from test_server_errors import assert_error
from test_server_load import wait_until

MAX_MODEL_LEN = 1024
MAX_WAITING = 64
READ_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 3.0
VOCAB = 512  # tiny_llama_dir's vocabulary


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama_dir, tmp_path_factory.mktemp("server_isolation_logs"),
                          extra_args=["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                                      "--max-waiting-requests", str(MAX_WAITING),
                                      "--read-timeout", str(READ_TIMEOUT_S),
                                      "--write-timeout", str(WRITE_TIMEOUT_S)])
    yield remote
    assert remote.terminate() == 0, remote.log()


def completion(server: RemoteServer, **fields: Any) -> httpx.Response:
    return server.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4, **fields})


def chat(server: RemoteServer, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return server.post("/v1/chat/completions", body)


def raw_post(server: RemoteServer, path: str, content: bytes) -> httpx.Response:
    """A body the json module would not write (NaN, Infinity, lone surrogates)."""
    return httpx.post(f"{server.url}{path}", content=content, timeout=60.0,
                      headers={"Content-Type": "application/json"})


def kv_idle(server: RemoteServer) -> bool:
    metrics = server.metrics()
    return metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:kv_cache_usage_perc"] == 0.0


def abort_count(server: RemoteServer, reason: str = "abort") -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("pagedllm:request_success_total") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- 1. nothing a client sends raises inside a step ------------------------------------------------

@pytest.mark.parametrize("top_k", [2 ** 63, 2 ** 64 + 5, 10 ** 30, VOCAB + 1])
def test_huge_top_k_is_clamped_to_the_vocabulary(server: RemoteServer, top_k: int) -> None:
    client = server.client()
    result = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=1.0, seed=1,
                                       extra_body={"top_k": top_k})
    unclamped = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=1.0, seed=1)
    assert result.choices[0].text == unclamped.choices[0].text  # top_k >= vocabulary means "off"
    server.assert_healthy()


@pytest.mark.parametrize("fields", [{"stop_token_ids": [9000], "min_tokens": 1},
                                    {"stop_token_ids": [VOCAB]},
                                    {"stop_token_ids": [2 ** 70]}])
def test_stop_token_ids_outside_the_vocabulary(server: RemoteServer, fields: dict[str, Any]) -> None:
    assert_error(chat(server, **fields), 400, "stop_token_ids")
    assert_error(completion(server, **fields), 400, "stop_token_ids")
    server.assert_healthy()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_non_finite_numbers_are_refused(server: RemoteServer, field: str, literal: str) -> None:
    body = f'{{"model": "tiny", "prompt": "hello", "max_tokens": 4, "{field}": {literal}}}'.encode()
    error = assert_error(raw_post(server, "/v1/completions", body), 400, field)
    assert "finite" in error["message"] or "must be" in error["message"]


def test_large_requests_get_a_400_naming_the_limit(server: RemoteServer) -> None:
    """Admission counts sequences (prompts x n); a request that could never be admitted is a 400."""
    error = assert_error(completion(server, prompt=[[5, 6, 7]] * 64, n=2), 400, "n")
    assert "--max-waiting-requests" in error["message"] and str(MAX_WAITING) in error["message"]
    assert_error(completion(server, prompt=["hi"] * (MAX_WAITING + 1)), 400, "prompt")
    assert_error(chat(server, n=MAX_WAITING + 1), 400, "n")
    assert completion(server, prompt=[[5, 6, 7]] * 8, n=8).status_code == 200  # 64 sequences fit
    server.assert_healthy()


def test_stop_lists_are_bounded(server: RemoteServer) -> None:
    """8. A 100,000-entry stop list (which made every other request slower) is refused."""
    error = assert_error(completion(server, stop=[f"s{i}" for i in range(100_000)]), 400, "stop")
    assert "max_stop_strings" in error["message"]
    assert_error(completion(server, stop=["x" * 5000]), 400, "stop")
    assert_error(completion(server, stop_token_ids=[5] * 5000), 400, "stop_token_ids")
    assert completion(server, stop=[f"s{i}" for i in range(100)]).status_code == 200
    server.assert_healthy()


# ---- 3. chat templates and tokenization ------------------------------------------------------------

LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("fields", [{"chat_template": LOOPING_TEMPLATE},
                                    {"chat_template_kwargs": {"chat_template": LOOPING_TEMPLATE}}])
def test_request_chat_templates_are_refused(server: RemoteServer, fields: dict[str, Any]) -> None:
    error = assert_error(chat(server, **fields), 400, next(iter(fields)))
    assert "--trust-request-chat-template" in error["message"]
    server.assert_healthy()


def test_chat_template_kwargs_cannot_set_apply_chat_template_arguments(server: RemoteServer) -> None:
    assert_error(chat(server, chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs")
    assert chat(server, chat_template_kwargs={"enable_thinking": False}).status_code == 200


def test_prompt_size_is_bounded_before_tokenizing(server: RemoteServer) -> None:
    limit = 32 * MAX_MODEL_LEN
    error = assert_error(completion(server, prompt="a" * (limit + 1)), 400, "prompt")
    assert "--max-prompt-chars" in error["message"]
    assert_error(chat(server, messages=[{"role": "user", "content": "a " * limit}]), 400, "messages")
    assert_error(server.post("/tokenize", {"prompt": "b" * (limit + 1)}), 400, "prompt")
    server.assert_healthy()


# ---- 7. lone surrogates ----------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "ok", "max_tokens": 2, "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_a_400(server: RemoteServer, path: str, body: str, param: str) -> None:
    assert_error(raw_post(server, path, body.encode()), 400, param)
    server.assert_healthy()


# ---- 10. small things ------------------------------------------------------------------------------

def test_max_completion_tokens_errors_name_it(server: RemoteServer) -> None:
    assert_error(chat(server, max_tokens=None, max_completion_tokens=MAX_MODEL_LEN), 400,
                 "max_completion_tokens")
    assert_error(chat(server, max_tokens=None, max_completion_tokens=2, min_tokens=5), 400, "min_tokens")
    assert_error(chat(server, max_tokens=MAX_MODEL_LEN), 400, "max_tokens")


def test_trailing_slash_answers_like_the_canonical_route(server: RemoteServer) -> None:
    for path in ("/v1/completions/", "/v1/chat/completions/"):
        body = {"prompt": "hi", "max_tokens": 2} if "chat" not in path else {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = server.post(path, body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"]
    assert server.get("/v1/models/").json()["data"][0]["id"] == "tiny"
    assert_error(server.post("/v1/completions/", {"max_tokens": 2}), 400, "prompt")


def test_models_never_show_a_filesystem_path(server: RemoteServer, tiny_llama_dir: str) -> None:
    card = server.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny"
    assert tiny_llama_dir not in json.dumps(card) and "/" not in (card.get("root") or "")


def test_served_model_name_defaults_to_the_directory_basename(tiny_llama_dir: str) -> None:
    import argparse
    import os

    from pagedllm.entrypoints.openai.server import ServerConfig

    config = ServerConfig.from_args(argparse.Namespace(served_model_name=None), tiny_llama_dir)
    assert config.served_model_names == [os.path.basename(tiny_llama_dir.rstrip("/"))]


# ---- 6. slow and stalled sockets -------------------------------------------------------------------

def connect(server: RemoteServer, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # set before connecting, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", server.port))
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_stalled_headers_are_closed(server: RemoteServer) -> None:
    """Slowloris: a connection that never completes its request headers is closed after --read-timeout."""
    sockets = [connect(server) for _ in range(50)]
    try:
        for sock in sockets:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        server.assert_healthy()  # the server answers others meanwhile
        for sock in sockets:
            assert read_until_closed(sock, 10 * READ_TIMEOUT_S) == b""
    finally:
        for sock in sockets:
            sock.close()


def test_stalled_body_gets_a_408(server: RemoteServer) -> None:
    sock = connect(server)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = read_until_closed(sock, 10 * READ_TIMEOUT_S)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":408' in answer.replace(b" ", b"")


def post_raw(sock: socket.socket, path: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


UNREAD_STREAM = {"model": "tiny", "prompt": "hello", "n": 16, "logprobs": 20, "max_tokens": MAX_MODEL_LEN - 8,
                 "ignore_eos": True, "stream": True, "temperature": 1.0}


def test_unread_stream_is_aborted_after_the_write_timeout(server: RemoteServer) -> None:
    """5/6. A client that stops reading its stream: after --write-timeout its request is aborted,
    its KV blocks freed and its connection closed, while other clients are served throughout."""
    before, finished_before = abort_count(server), abort_count(server, "length")
    sock = connect(server, receive_buffer=4096)
    try:
        post_raw(sock, "/v1/completions", UNREAD_STREAM)
        # The engine core (its own process) does not wait for slow readers, as in vLLM: on a warm, idle
        # server the samples may all reach max_tokens before the write timeout, and then there is nothing
        # left to abort. Either way the request must end.
        wait_until(lambda: abort_count(server) >= before + 1
                   or abort_count(server, "length") >= finished_before + UNREAD_STREAM["n"],
                   300.0, "the unread stream to be aborted or finished")
        wait_until(lambda: kv_idle(server), 60.0, "its KV blocks to be freed")
        assert completion(server).status_code == 200
        read_until_closed(sock, 60.0)  # the server closed the connection
    finally:
        sock.close()
    server.assert_healthy()


# ---- 4. the waiting limit holds under a burst --------------------------------------------------------

def test_burst_never_exceeds_the_waiting_limit(server: RemoteServer) -> None:
    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=300.0) as client:
            async def one(i: int) -> int:
                body = {"model": "tiny", "prompt": f"burst {i}", "max_tokens": 8, "ignore_eos": True}
                response = await client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    assert_error(response, 503)
                return response.status_code
            return await asyncio.gather(*(one(i) for i in range(300)))

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 503} and len(statuses) == 300
    metrics = server.metrics()
    assert 0 < metrics["pagedllm:server_waiting_sequences_peak"] <= MAX_WAITING
    wait_until(lambda: server.metrics()["pagedllm:server_waiting_sequences"] == 0, 60.0,
               "the admission count to return to zero")
    server.assert_healthy()


# ---- the whole schema, fuzzed -------------------------------------------------------------------------

hostile_ints = st.sampled_from([0, 1, -1, 2, 5, VOCAB - 1, VOCAB, 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1,
                                10 ** 30])
hostile_floats = st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, -2.5, 1e-30, 1e30, 1e308, -1e308, math.inf,
                                  -math.inf, math.nan])
hostile_text = st.sampled_from(["", "x", "hello world", "\ud800", "a" * 2000, "\x00", "<|eos|>", "é" * 50])
small_ints = st.integers(-2, 6)
token_lists = st.lists(hostile_ints | small_ints, max_size=5)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                           "content": hostile_text | st.none()}), min_size=0, max_size=3)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": small_ints | hostile_ints, "max_completion_tokens": small_ints | hostile_ints,
    "temperature": hostile_floats, "top_p": hostile_floats, "top_k": hostile_ints | small_ints,
    "min_p": hostile_floats, "presence_penalty": hostile_floats, "frequency_penalty": hostile_floats,
    "repetition_penalty": hostile_floats, "n": st.integers(-1, 3) | hostile_ints, "seed": hostile_ints,
    "logprobs": small_ints | hostile_ints | st.booleans(), "top_logprobs": small_ints | hostile_ints,
    "stop": hostile_text | st.lists(hostile_text, max_size=3), "stop_token_ids": token_lists,
    "min_tokens": small_ints | hostile_ints, "echo": st.booleans(), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "best_of": small_ints,
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "chat_template_kwargs": st.none() | st.dictionaries(st.sampled_from(["chat_template", "tokenize", "x"]),
                                                        hostile_text, max_size=2),
    "add_generation_prompt": st.booleans(), "suffix": st.none() | hostile_text,
    "model": st.sampled_from(["tiny", "other", ""]),
}
PROMPTS = hostile_text | token_lists | st.lists(token_lists, max_size=3) | st.lists(hostile_text, max_size=3)


def bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Keep the valid requests small, so the fuzz test is about input, not load."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value:
            body[name] = min(value, 4)
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       fields=st.fixed_dictionaries({}, optional=FIELDS), prompt=PROMPTS, chat_messages=messages)
def test_fuzzed_schema_never_5xx(server: RemoteServer, path: str, fields: dict[str, Any], prompt: Any,
                                 chat_messages: list[dict[str, Any]]) -> None:
    body = bounded(dict(fields))
    if path == "/v1/chat/completions" or (path == "/tokenize" and chat_messages and not isinstance(prompt, str)):
        body["messages"] = chat_messages
    elif path == "/detokenize":
        body["tokens"] = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else [5]
    else:
        body["prompt"] = prompt
    # json.dumps writes NaN/Infinity literals and surrogate escapes, as a hostile client would
    content = json.dumps(body).encode()
    if body.get("stream"):
        with httpx.stream("POST", f"{server.url}{path}", content=content, timeout=60.0,
                          headers={"Content-Type": "application/json"}) as response:
            text = response.read().decode(errors="replace")
            status = response.status_code
        assert status < 500, text
        if status == 200 and "text/event-stream" in response.headers.get("content-type", ""):
            assert text.rstrip().endswith("data: [DONE]"), text[-500:]
            assert '"code": 5' not in text and '"code":5' not in text, text[-500:]
    else:
        response = raw_post(server, path, content)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert_error(response, response.status_code)
    assert httpx.get(f"{server.url}/health", timeout=10.0).status_code == 200


# ---- 10. the log stays clean: no traceback from anything above (disconnects included) ----------------

def test_client_disconnect_logs_no_traceback(server: RemoteServer) -> None:
    before = abort_count(server)
    body = {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "n": 8, "logprobs": 20}
    server.post_and_hang_up("/v1/completions", body, running=8)
    wait_until(lambda: abort_count(server) >= before + 1, 60.0, "the abandoned request to be aborted")
    server.assert_healthy()
    log = server.log_path.read_text(errors="replace")
    assert "CancelledError" not in log and "Traceback" not in log, log[-4000:]


# ---- 5. a never-read stream's memory stays flat --------------------------------------------------------

def rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


@pytest.mark.slow
def test_never_read_stream_memory_stays_flat(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
                                             ) -> None:
    """n=16 samples with 20 logprobs over ~1,000 tokens, never read: outputs are cumulative, so an
    unbounded queue held every step's copy (quadratic: hundreds of MiB); the coalescing queue holds
    one. The write timeout is long here, so the whole generation runs while the socket is unread."""
    server = RemoteServer(tiny_llama_dir, tmp_path_factory.mktemp("server_memory_logs"),
                          extra_args=["--max-model-len", str(MAX_MODEL_LEN), "--write-timeout", "600"])
    sock = None
    try:
        # warm up every code path with the same shape, so the baseline includes the allocator's pools
        assert completion(server, n=16, logprobs=20, max_tokens=16).status_code == 200
        baseline = rss_kib(server.proc.pid, "VmRSS")
        finished_before = server.metrics().get("pagedllm:request_success_total", 0)
        sock = connect(server, receive_buffer=4096)
        post_raw(sock, "/v1/completions", UNREAD_STREAM)
        wait_until(lambda: server.metrics().get("pagedllm:request_success_total", 0) > finished_before, 600.0,
                   "the unread request to finish generating")
        peak = rss_kib(server.proc.pid, "VmHWM")
        growth_mib = (peak - baseline) / 1024
        print(f"never-read stream: server peak RSS grew {growth_mib:.0f} MiB")  # shown with pytest -s
        # generous: the request's own state (16 x 1,000 positions x 21 logprobs) takes about 100 MiB
        # here; the unbounded queue of every step's cumulative copy took 245 MiB
        assert growth_mib < 170, f"server RSS grew {growth_mib:.0f} MiB for one unread stream"
        server.assert_healthy()
    finally:
        if sock is not None:
            sock.close()
        assert server.terminate() == 0, server.log()


# ---- 2. a step that still fails ends only its culprit ----------------------------------------------------

POISON_SEED = 666


def poison_sampler(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: sampling raises for any batch holding a request with seed POISON_SEED (no
    input can do this any more; a bug still could)."""
    runner = engine.model_runner
    real = runner.sampler

    class PoisonedSampler:
        def __call__(self, logits: Any, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
            if any(row.params.seed == POISON_SEED for row in rows):
                raise IndexError("index 9000 is out of bounds for dimension 1 with size 512")
            return real(logits, rows, *args, **kwargs)

    monkeypatch.setattr(runner, "sampler", PoisonedSampler())


def test_a_failing_request_is_ended_alone(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiny_models import metric_values

    from pagedllm import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import heapq\n", "Hello, world! How are"]
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = llm.llm_engine
    poison_sampler(engine, monkeypatch)
    engine.add_request("victim-0", prompts[0], greedy)
    engine.add_request("culprit", prompts[1], SamplingParams(temperature=1.0, seed=POISON_SEED, n=3, max_tokens=12))
    engine.add_request("victim-1", prompts[2], greedy)
    finals, failed = {}, {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        failed.update(engine.failed_requests)
    assert set(failed) == {"culprit"} and "culprit" not in finals
    assert [finals["victim-0"].outputs[0].text, finals["victim-1"].outputs[0].text] == [expected[0], expected[2]]
    metrics = metric_values(llm)
    assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
    with pytest.raises(RuntimeError, match="failed inside the engine"):  # LLM.generate reports it
        llm.generate([prompts[1]], SamplingParams(seed=POISON_SEED, max_tokens=4), use_tqdm=False)
    monkeypatch.undo()
    # the culprit's blocks left no hash behind for KV it never wrote: its prompt runs as before
    assert llm.generate([prompts[1]], greedy, use_tqdm=False)[0].outputs[0].text == expected[1]


def test_server_answers_a_failing_request_generically(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """In-process (fault injection needs the engine at hand): the culprit gets a 500 that says
    'internal server error' and a request id, the exception text goes to the log, and a concurrent
    request gets its normal answer."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.server import ServerConfig, build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=256),
                                             multiprocess=False)
    poison_sampler(engine.engine_core.model_executor.driver_worker, monkeypatch)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("pagedllm").addHandler(handler)
    app = build_app(engine, ServerConfig(served_model_names=["tiny"]))
    engine.start()

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120.0) as client:
            victim = {"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
            culprit = {"prompt": "import heapq\n", "max_tokens": 8, "seed": POISON_SEED}
            stream = {**culprit, "stream": True}
            return await asyncio.gather(client.post("/v1/completions", json=victim),
                                        client.post("/v1/completions", json=culprit),
                                        client.post("/v1/completions", json=stream))

    try:
        victim, culprit, stream = asyncio.run(scenario())
    finally:
        engine.shutdown()
        logging.getLogger("pagedllm").removeHandler(handler)
    assert victim.status_code == 200 and victim.json()["choices"][0]["finish_reason"] == "length"
    error = assert_error(culprit, 500)
    assert error["message"].startswith("internal server error (request id ")
    assert "9000" not in culprit.text and "IndexError" not in culprit.text
    events = [line for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"code": 500' in events[-2] and "9000" not in stream.text
    logged = [record.exc_info[1] for record in records if record.exc_info]
    assert any("index 9000 is out of bounds" in str(exc) for exc in logged)  # the details are in the log
