"""The OpenAI-compatible server (issue 5): the real `pagedllm serve` in a subprocess, on a free loopback
port, spoken to with the real `openai` client and with raw HTTP.

With a fixed seed (or greedy sampling) the server's text equals what `LLM.generate` / `LLM.chat` give
offline for the same prompt and parameters: the server adds transport, never different results.
RemoteServer is shared by test_server_errors.py and test_server_load.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.tokenizer import load_tokenizer

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--seed", "0"]
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """`pagedllm serve MODEL ...` as a child process, ready once /health answers 200."""

    def __init__(self, model_dir: str | None, log_dir: Path, extra_args: list[str] | None = None,
                 api_key: str | None = None, served_model_name: str | None = "tiny") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"server-{self.port}.log"
        args = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([model_dir] if model_dir else []),
                "--port", str(self.port), *ENGINE_FLAGS, *(extra_args or [])]
        if served_model_name is not None:
            args += ["--served-model-name", served_model_name]
        if api_key is not None:
            args += ["--api-key", api_key]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PAGEDLLM_API_KEY": ""}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            try:  # waiting on the process doubles as the pause between polls
                self.proc.wait(timeout=0.25)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            except subprocess.TimeoutExpired:
                pass
        self.proc.kill()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120.0, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        timeout = kwargs.pop("timeout", 120.0)
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=timeout, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=60.0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name (label sets summed), e.g. 'pagedllm:num_requests_running'."""
        values: dict[str, float] = {}
        for line in self.get("/metrics").text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_and_labels, value = line.rsplit(" ", 1)
            name = name_and_labels.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
        return values

    def terminate(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def post_and_hang_up(self, path: str, body: Any, running: int = 1) -> None:
        """POST body, then close the connection unread once /metrics shows `running` sequences running.

        A hang-up tied to the request's admission, not to a client timer: however fast or slow the engine
        is, the request is mid-generation when the connection closes (give it thousands of tokens)."""
        content = json.dumps(body).encode()
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {len(content)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", self.port)) as connection:
            connection.sendall(head + content)
            deadline = time.monotonic() + 60.0
            while self.metrics().get("pagedllm:num_requests_running", 0) < running:
                assert time.monotonic() < deadline, f"the request never had {running} sequences running"

    def assert_healthy(self) -> None:
        assert self.proc.poll() is None, self.log()
        assert httpx.get(f"{self.url}/health", timeout=30.0).status_code == 200


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of a server-sent event stream; '[DONE]' stays a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama_dir, tmp_path_factory.mktemp("server_logs"))
    yield remote
    assert remote.terminate() == 0, remote.log()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    """The offline reference, built with the same engine arguments as the server."""
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, seed=0)


PROMPT = "def fibonacci(n):"
PROMPTS = ["def fibonacci(n):", "Hello, world! How are", "import heapq\n"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def offline(llm: LLM, prompt: Any, **kwargs: Any) -> list[str]:
    outputs = llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)
    return [completion.text for output in outputs for completion in output.outputs]


# ---- the command line ----------------------------------------------------------------------------

def test_serve_flags() -> None:
    """`pagedllm serve` takes its own flags plus every engine argument, spelled as in vLLM."""
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "some/model", "--port", "9001", "--api-key", "k",
                                      "--served-model-name", "a", "b", "--max-waiting-requests", "3",
                                      "--block-size", "32", "--max-num-batched-tokens", "512",
                                      "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8"])
    assert (args.model_tag, args.host, args.port, args.api_key) == ("some/model", "127.0.0.1", 9001, "k")
    assert args.served_model_name == ["a", "b"] and args.max_waiting_requests == 3
    assert (args.block_size, args.max_num_batched_tokens, args.enable_prefix_caching) == (32, 512, False)
    assert args.kv_cache_dtype == "fp8"
    assert build_parser().parse_args(["serve"]).model_tag is None  # the bundled demo model


# ---- the small endpoints -------------------------------------------------------------------------

def test_health_version_models(server: RemoteServer, client: openai.OpenAI) -> None:
    assert server.get("/health").status_code == 200
    assert server.get("/version").json()["version"]
    models = client.models.list()
    assert [model.id for model in models.data] == ["tiny"]
    assert models.data[0].object == "model"
    card = server.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 256 and card["owned_by"] == "pagedllm"


def test_the_model_path_as_given_names_the_model(server: RemoteServer, tiny_llama_dir: str) -> None:
    """vLLM's default served name is the model argument itself: a client that sends it is answered (under
    the served name), though /v1/models lists the name only."""
    result = server.post("/v1/completions", {"model": tiny_llama_dir, "prompt": PROMPT, "max_tokens": 2})
    assert result.status_code == 200 and result.json()["model"] == "tiny"


def test_tokenize_detokenize(server: RemoteServer, llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    body = server.post("/tokenize", {"model": "tiny", "prompt": PROMPT}).json()
    assert body["tokens"] == tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert server.post("/detokenize", {"model": "tiny", "tokens": body["tokens"]}).json()["prompt"] == \
        tokenizer.decode(body["tokens"])
    chat = server.post("/tokenize", {"messages": MESSAGES}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


def test_chat_template_flag_replaces_the_models(tiny_llama_dir: str, tmp_path: Path) -> None:
    """--chat-template (vLLM's): a Jinja file, or the template itself, renders every chat request."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    remote = RemoteServer(tiny_llama_dir, tmp_path, extra_args=["--chat-template", str(template)])
    try:
        tokens = remote.post("/tokenize", {"messages": MESSAGES}).json()["tokens"]
        tokenizer = load_tokenizer(tiny_llama_dir)
        assert tokens == tokenizer.encode("<system>You are terse.<user>Say hi.", add_special_tokens=False)
    finally:
        assert remote.terminate() == 0, remote.log()


# ---- completions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7},
                                      {"temperature": 1.0, "top_k": 20, "seed": 3}])
def test_completion_equals_offline(client: openai.OpenAI, llm: LLM, sampling: dict[str, Any]) -> None:
    extra = {key: sampling[key] for key in ("top_k",) if key in sampling}
    plain = {key: value for key, value in sampling.items() if key not in extra}
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, extra_body=extra, **plain)
    want = offline(llm, PROMPT, max_tokens=12, **sampling)
    assert result.choices[0].text == want[0]
    assert result.id.startswith("cmpl-") and result.object == "text_completion" and result.created > 0
    assert result.model == "tiny"
    completion_tokens = len(llm.generate(PROMPT, SamplingParams(max_tokens=12, **sampling),
                                         use_tqdm=False)[0].outputs[0].token_ids)
    prompt_tokens = len(llm.get_tokenizer().encode(PROMPT))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == \
        (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def test_completion_stream_equals_offline(client: openai.OpenAI, llm: LLM) -> None:
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.8, seed=11,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == offline(llm, PROMPT, max_tokens=20, temperature=0.8, seed=11)[0]
    assert len({chunk.id for chunk in chunks}) == 1
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(chunk.usage is None for chunk in chunks[:-1])
    usage = chunks[-1].usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_n_and_prompt_list(client: openai.OpenAI, llm: LLM) -> None:
    """Two prompts x n=3: choice i*n + j is sample j of prompt i, as offline."""
    result = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=8, temperature=1.0,
                                       seed=5)
    assert [choice.index for choice in result.choices] == list(range(6))
    want = offline(llm, PROMPTS[:2], n=3, max_tokens=8, temperature=1.0, seed=5)
    assert [choice.text for choice in result.choices] == want
    assert len(set(want[:3])) > 1, "samples of one prompt differ (the test would be vacuous otherwise)"

    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=8,
                                           temperature=1.0, seed=5, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(6)] == want


def test_completion_token_id_prompts(client: openai.OpenAI, llm: LLM) -> None:
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=6, temperature=0.0)
    many = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0.0)
    want = offline(llm, PROMPTS, max_tokens=6, temperature=0.0)
    assert one.choices[0].text == want[0]
    assert [choice.text for choice in many.choices] == want
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_completion_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=3)
    logprobs = result.choices[0].logprobs
    reference = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3),
                             use_tqdm=False)[0].outputs[0]
    assert len(logprobs.tokens) == len(reference.token_ids) == result.usage.completion_tokens
    for position, token_id in enumerate(reference.token_ids):
        want = reference.logprobs[position][token_id].logprob
        assert logprobs.token_logprobs[position] == pytest.approx(want, abs=1e-4)
        top = logprobs.top_logprobs[position]
        # OpenAI keys top_logprobs by token text, so two ids that decode alike ("\ufffd") share a key
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(max(
            lp.logprob for lp in reference.logprobs[position].values()), abs=1e-4)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    # greedy: the sampled token is the most likely one
    assert all(lp == pytest.approx(max(top.values()), abs=1e-5)
               for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs))

    streamed = [choice.logprobs for chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=3, stream=True)
        for choice in chunk.choices if choice.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset


def test_completion_echo(client: openai.OpenAI, llm: LLM) -> None:
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0, echo=True)
    assert result.choices[0].text == PROMPT + offline(llm, PROMPT, max_tokens=5, temperature=0.0)[0]
    with_logprobs = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0,
                                              echo=True, logprobs=1)
    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.tokens) == prompt_len + 5
    assert logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    # offsets run on over the token strings, the prompt's included (as vLLM's)
    offsets, tokens = logprobs.text_offset, logprobs.tokens
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_without_generation_scores_the_prompt(server: RemoteServer, llm: LLM, stream: bool) -> None:
    """echo with max_tokens 0 (vLLM's; lm-eval's loglikelihood requests): the prompt and its logprobs,
    nothing generated. max_tokens 0 without echo is refused."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    want = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers(),
                          timeout=60.0) as response:
            events = [e for e in sse_events(response) if e != "[DONE]"]
        text = "".join(choice["text"] for event in events for choice in event["choices"])
        logprobs = [lp for event in events for choice in event["choices"] if choice["logprobs"]
                    for lp in choice["logprobs"]["token_logprobs"]]
        finish = [choice["finish_reason"] for event in events for choice in event["choices"]][-1]
    else:
        result = server.post("/v1/completions", body).json()
        choice = result["choices"][0]
        text, logprobs, finish = choice["text"], choice["logprobs"]["token_logprobs"], choice["finish_reason"]
        assert result["usage"]["completion_tokens"] == 0
    assert text == PROMPT and finish == "length"
    assert len(logprobs) == len(want.prompt_token_ids) and logprobs[0] is None
    for got, position, token in zip(logprobs[1:], want.prompt_logprobs[1:], want.prompt_token_ids[1:]):
        assert got == pytest.approx(position[token].logprob, abs=1e-4)
    refused = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_return_tokens_as_token_ids(server: RemoteServer) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name their tokens "token_id:N" (RL frameworks read ids)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "logprobs": 2,
            "return_tokens_as_token_ids": True}
    plain = server.post("/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    choice = server.post("/v1/completions", body).json()["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens) and len(tokens) == len(plain["logprobs"]["tokens"])
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    assert choice["text"] == plain["text"]
    chat = server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 3,
                                                "logprobs": True, "top_logprobs": 1,
                                                "return_tokens_as_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") and c["top_logprobs"][0]["token"].startswith("token_id:")
               for c in content)


def test_prompt_logprobs_come_with_the_response_as_vllms(server: RemoteServer, llm: LLM) -> None:
    """vLLM's prompt_logprobs extra: per prompt position (None for the first) the prompt token's and the
    top k's logprob, rank and text; on completions in each choice, on chat beside the choices; refused
    when streamed."""
    want = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    choice = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                             "prompt_logprobs": 2}).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for position, expected in zip(got[1:], want.prompt_logprobs[1:]):
        assert set(position) == {str(token) for token in expected}
        for token, logprob in expected.items():
            entry = position[str(token)]
            assert entry["logprob"] == pytest.approx(logprob.logprob, abs=1e-4) and entry["rank"] == logprob.rank
            assert entry["decoded_token"] == logprob.decoded_token
    chat = server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(step) == 1 for step in chat["prompt_logprobs"][1:])
    plain = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    refused = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                              "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_completion_stop_strings(client: openai.OpenAI, llm: LLM) -> None:
    full = offline(llm, PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)[0]
    assert len(full) > 6
    stop = full[3:6]
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0,
                                       stop=[stop], extra_body={"ignore_eos": True})
    want = offline(llm, PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])[0]
    assert result.choices[0].text == want == full[:full.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    streamed = "".join(choice.text for chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) for choice in chunk.choices)
    assert streamed == want


def test_vllm_extras_reach_the_engine(client: openai.OpenAI, llm: LLM) -> None:
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 4, "ignore_eos": True}
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.7, seed=2,
                                       presence_penalty=0.5, frequency_penalty=0.3, user="someone",
                                       extra_body=extras)
    want = offline(llm, PROMPT, max_tokens=10, temperature=0.7, seed=2, presence_penalty=0.5,
                   frequency_penalty=0.3, **extras)
    assert result.choices[0].text == want[0]
    assert result.usage.completion_tokens == 10 and result.choices[0].finish_reason == "length"


def test_stop_token_ids(client: openai.OpenAI, llm: LLM) -> None:
    full = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[4]
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                       extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    choice = result.choices[0]
    assert choice.text == want.text and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id == want.stop_reason
    assert result.usage.completion_tokens == full.token_ids.index(stop_id) + 1


def test_logit_bias_and_allowed_token_ids_reach_the_engine(client: openai.OpenAI, llm: LLM) -> None:
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0].outputs[0]
    bias = {plain.token_ids[0]: -100.0}
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0,
                                       logit_bias={str(t): b for t, b in bias.items()})
    assert result.choices[0].text == offline(llm, PROMPT, max_tokens=6, temperature=0.0, logit_bias=bias)[0]
    assert result.choices[0].text != plain.text
    allowed = [5, 77, 300]
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5,
                                       extra_body={"allowed_token_ids": allowed})
    assert result.choices[0].text == offline(llm, PROMPT, max_tokens=6, temperature=1.0, seed=5,
                                             allowed_token_ids=allowed)[0]
    bad_words = [plain.text.split()[0]] if plain.text.split() else ["the"]
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0,
                                       extra_body={"bad_words": bad_words})
    assert result.choices[0].text == offline(llm, PROMPT, max_tokens=6, temperature=0.0, bad_words=bad_words)[0]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: RemoteServer, llm: LLM) -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens of the prompt (-1: as many as the context holds,
    so a prompt past the context is cut instead of refused)."""
    ids = llm.get_tokenizer()(PROMPT * 3)["input_ids"]
    body = {"model": "tiny", "prompt": PROMPT * 3, "max_tokens": 5, "temperature": 0.0,
            "truncate_prompt_tokens": 4}
    result = server.post("/v1/completions", body).json()
    want = llm.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(max_tokens=5, temperature=0.0),
                        use_tqdm=False)[0].outputs[0].text
    assert result["choices"][0]["text"] == want and result["usage"]["prompt_tokens"] == 4
    long_prompt = list(range(10, 10 + 300))  # past max_model_len (256)
    body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 1, "truncate_prompt_tokens": -1}
    assert server.post("/v1/completions", body).json()["usage"]["prompt_tokens"] == 255
    refused = server.post("/v1/completions", {**body, "truncate_prompt_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"


# ---- chat ----------------------------------------------------------------------------------------

def offline_chat(llm: LLM, **kwargs: Any) -> list[str]:
    outputs = llm.chat(MESSAGES, SamplingParams(**kwargs), use_tqdm=False)
    return [completion.text for completion in outputs[0].outputs]


def test_chat_equals_offline(client: openai.OpenAI, llm: LLM) -> None:
    result = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.8,
                                            seed=4)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == offline_chat(llm, max_tokens=12, temperature=0.8, seed=4)[0]
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert result.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_chat_content_parts_and_continue_final_message(server: RemoteServer, llm: LLM) -> None:
    """OpenAI's text content parts read as their text, offline and served alike; continue_final_message
    (vLLM's) extends a started assistant reply instead of opening a turn."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}]
    sampling = SamplingParams(max_tokens=8, temperature=0.0)
    body = {"model": "tiny", "messages": parts, "max_tokens": 8, "temperature": 0.0}
    served = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    want = llm.chat([{"role": "user", "content": "Say\nhi."}], sampling, use_tqdm=False)[0].outputs[0].text
    assert served == want == llm.chat(parts, sampling, use_tqdm=False)[0].outputs[0].text
    started = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
    body = {"model": "tiny", "messages": started, "max_tokens": 8, "temperature": 0.0,
            "add_generation_prompt": False, "continue_final_message": True}
    served = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    offline_out = llm.chat(started, sampling, continue_final_message=True, use_tqdm=False)[0]
    assert served == offline_out.outputs[0].text and offline_out.prompt.endswith("Hel")
    # echo (vLLM's): the reply starts with the last message's text, it being the assistant's
    echoed = server.post("/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed["content"] == "Hel" + served
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "echo": True, "stream": True},
                      headers=server.headers(), timeout=60.0) as response:
        events = [e for e in sse_events(response) if e != "[DONE]"]
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == "Hel" + served
    tokens = server.post("/tokenize", {"model": "tiny", "messages": started, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()["tokens"]
    assert tokens == llm.get_tokenizer()(offline_out.prompt, add_special_tokens=False)["input_ids"]


def test_chat_stream(client: openai.OpenAI, llm: LLM) -> None:
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                                 temperature=0.0, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    first = chunks[0].choices
    assert sorted(choice.index for choice in first) == [0, 1]
    assert all(choice.delta.role == "assistant" for choice in first)
    texts = ["", ""]
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    want = offline_chat(llm, max_tokens=12, temperature=0.0)[0]
    assert texts == [want, want]
    assert set(finishes) == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0,
                                            logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_raw_http_shape(server: RemoteServer) -> None:
    body = server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                                "temperature": 0}).json()
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60.0,
                      json={"messages": MESSAGES, "max_tokens": 4, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"


# ---- metrics -------------------------------------------------------------------------------------

def test_metrics(server: RemoteServer, client: openai.OpenAI) -> None:
    before = server.metrics()
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"pagedllm:{name}" in after
    assert after["pagedllm:generation_tokens_total"] - before.get("pagedllm:generation_tokens_total", 0) == 5
    assert after["pagedllm:prompt_tokens_total"] > before.get("pagedllm:prompt_tokens_total", 0)
    assert after["pagedllm:request_success_total"] == before.get("pagedllm:request_success_total", 0) + 1
    for name in ("num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"pagedllm:{name}" in after
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "inter_token_latency_seconds"):
        assert after[f"pagedllm:{name}_count"] > before.get(f"pagedllm:{name}_count", 0)
    assert after["pagedllm:num_requests_running"] == 0
    text = server.get("/metrics").text
    assert 'pagedllm:request_success_total{finished_reason="length"' in text or \
        'finished_reason="length"' in text


# ---- the AsyncLLMEngine in-process ----------------------------------------------------------------

def run_async(coroutine: Any) -> Any:
    import asyncio

    return asyncio.run(coroutine)


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir: str) -> Iterator[Any]:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine

    # the core on a thread of this process, so a test can reach into it
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=256),
                                             multiprocess=False)
    engine.start()
    yield engine
    engine.shutdown()


def engine_metric(engine: Any, name: str) -> float:
    return sum(metric.value for metric in engine.engine_core.get_metrics() if metric.name == name)


def test_async_engine_generate_and_abort(async_engine: Any, llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def scenario() -> tuple[list[str], int]:
        texts = [output.outputs[0].text async for output in async_engine.generate(PROMPT, params, "a-1")]
        seen = 0
        long_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async for _ in async_engine.generate(PROMPT, long_params, "a-2"):
            seen += 1
            if seen == 3:
                break  # leaving early aborts the request and frees its blocks
        return texts, seen

    texts, seen = run_async(scenario())
    assert texts[-1] == offline(llm, PROMPT, max_tokens=8, temperature=0.0)[0]
    assert all(texts[-1].startswith(text) for text in texts), "outputs are cumulative"
    assert seen == 3

    async def counts() -> tuple[float, float]:
        metrics = await async_engine.get_metrics()
        values = {metric.name: metric.value for metric in metrics if not metric.labels}
        return values["pagedllm:num_requests_running"], values["pagedllm:kv_cache_usage_perc"]

    # the abort reaches the core before this call does (one queue, in order)
    assert run_async(counts()) == (0, 0.0)


def test_async_engine_survives_a_failed_step(async_engine: Any, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.engine.async_engine import EngineStepError

    real_step = async_engine.engine_core.step
    calls = {"n": 0}

    def failing_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(async_engine.engine_core, "step", failing_step)
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def scenario() -> str:
        with pytest.raises(EngineStepError) as info:
            async for _ in async_engine.generate(PROMPT, params, "b-1"):
                pass
        assert "injected failure" not in str(info.value), "internal details go to the log only"
        outputs = [output async for output in async_engine.generate(PROMPT, params, "b-2")]
        return outputs[-1].outputs[0].text

    assert run_async(scenario()) == offline(llm, PROMPT, max_tokens=8, temperature=0.0)[0]
    assert async_engine.is_running


def test_async_engine_rejects_bad_input_before_any_output(async_engine: Any) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="prompt"):
            await async_engine.add_request("c-1", [10 ** 6], SamplingParams())
        assert async_engine.num_waiting_requests == 0

    run_async(scenario())
