"""`pagedllm chat`: talk to a model in the terminal, offline on a model or against a running server.

Offline (`pagedllm chat [MODEL]`, the default model when none is given) the engine runs in this process
and the reply streams as it is generated; with `--url http://HOST:PORT/v1` the conversation goes to an
OpenAI-compatible server's /v1/chat/completions (streamed), as `vllm chat` does. History is kept
across turns; `/reset` clears it, `/exit` or Ctrl-D leaves. `--quick "..."` asks one question, prints
the answer and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.generate_cmd import add_sampling_args, sampling_params_from_args

HELP_LINE = "Type a message; /reset clears the history, /exit or Ctrl-D leaves."


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="chat with a model in the terminal",
                                   description="Chat with a model in the terminal, offline or against a server.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a local Hugging Face model directory or .gguf file (default: the default model, "
                             "SmolLM2-135M-Instruct, fetched once)")
    parser.add_argument("--model", default=None, help="the same as MODEL; with --url, the served model name "
                                                      "(default: the server's first)")
    parser.add_argument("--url", default=None, help="chat with a running server instead, e.g. "
                                                    "http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=None, help="with --url: the server's API key")
    parser.add_argument("--system", default=None, help="a system prompt at the head of the conversation")
    parser.add_argument("--quick", default=None, metavar="MESSAGE",
                        help="send one message, print the reply and exit")
    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    parser.set_defaults(func=run)


class OfflineChat:
    """The engine in this process; replies stream from its DELTA outputs."""

    def __init__(self, args: argparse.Namespace, model: str):
        from pagedllm.llm import LLM

        engine_args = EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "model": model}))
        self.llm = LLM(**vars(engine_args))
        self.params = sampling_params_from_args(args, self.llm.llm_engine.model_config.get_diff_sampling_param())
        self.name = model

    def reply(self, messages: list[dict[str, str]]) -> Iterator[str]:
        import torch

        from pagedllm.llm import render_chat_text
        from pagedllm.sampling_params import RequestOutputKind

        tokenizer = self.llm.get_tokenizer()
        text = render_chat_text(tokenizer, messages)
        prompt = {"prompt": text, "prompt_token_ids": list(tokenizer(text, add_special_tokens=False)["input_ids"])}
        params = self.params.clone()
        params.output_kind = RequestOutputKind.DELTA
        params.n = 1
        engine = self.llm.llm_engine
        request_id = engine.next_request_id()
        engine.add_request(request_id, prompt, params)
        try:
            with torch.inference_mode():
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.request_id == request_id and output.outputs:
                            yield output.outputs[0].text
                    if request_id in engine.failed_requests:
                        raise RuntimeError("the request failed inside the engine (see the log)")
        finally:  # Ctrl-C mid-reply: the request ends, its blocks go back
            if engine.has_unfinished_requests():
                engine.abort_request([request_id])


class ServerChat:
    """A running OpenAI-compatible server; replies stream as server-sent events."""

    def __init__(self, args: argparse.Namespace):
        import httpx

        self.base_url = args.url.rstrip("/")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(600.0, connect=10.0))
        self.name = args.model or args.model_tag or self._first_model()
        self.body: dict[str, Any] = {key: getattr(args, key) for key in
                                     ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                                     if getattr(args, key) is not None}
        if args.sampling_seed is not None:
            self.body["seed"] = args.sampling_seed
        if args.stop:
            self.body["stop"] = args.stop

    def _first_model(self) -> str:
        response = self.client.get(f"{self.base_url}/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        if not models:
            raise ValueError(f"--url {self.base_url}: the server lists no models.")
        return models[0]["id"]

    def reply(self, messages: list[dict[str, str]]) -> Iterator[str]:
        body = {**self.body, "model": self.name, "messages": messages, "stream": True}
        with self.client.stream("POST", f"{self.base_url}/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                try:
                    message = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = response.text
                raise ValueError(f"the server answered {response.status_code}: {message}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("error"):
                    raise RuntimeError(f"the server's stream ended with an error: {event['error'].get('message')}")
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        yield content


def _resolve_model(args: argparse.Namespace) -> str:
    from pagedllm.assets import installed_model_path

    tag, flag = args.model_tag, args.model
    if tag and flag and tag != flag:
        raise ValueError(f"two models given: {tag!r} (positional) and --model {flag!r}; give one.")
    model = tag or flag or installed_model_path()
    if model is None:
        raise ValueError("no model given and no default model is available; pass MODEL")
    return model


def _answer(chat, messages: list[dict[str, str]]) -> str:
    pieces = []
    for piece in chat.reply(messages):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)


def run(args: argparse.Namespace) -> int:
    if args.n != 1:
        raise ValueError("--n must be 1 for chat (one reply per turn).")
    chat = ServerChat(args) if args.url else OfflineChat(args, _resolve_model(args))
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    if args.quick is not None:
        _answer(chat, [*history, {"role": "user", "content": args.quick}])
        return 0
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - not on every platform
        pass
    print(f"Chatting with {chat.name}. {HELP_LINE}", file=sys.stderr)
    conversation = list(history)
    while True:
        try:
            message = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        command = message.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            conversation = list(history)
            print("(history cleared)", file=sys.stderr)
            continue
        if not command:
            continue
        conversation.append({"role": "user", "content": message})
        try:
            reply = _answer(chat, conversation)
        except KeyboardInterrupt:  # stops this reply, not the chat
            print("\n(interrupted)", file=sys.stderr)
            conversation.pop()
            continue
        conversation.append({"role": "assistant", "content": reply})
