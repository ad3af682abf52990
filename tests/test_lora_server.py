"""LoRA adapters through the OpenAI server (issue 45), with the real openai client: --lora-modules (both
spellings), /v1/models listing them with their parent, the `model` field picking one (tokens equal the
offline engine's under that adapter), runtime load/unload and their refusals, per-adapter metrics."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from test_server import RemoteServer
from tiny_models import build_lora_adapter, build_model

from pagedllm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")

PROMPT = [5, 17, 42, 99, 7, 250]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_server")
    base = build_model(root / "base", "llama", seed=46)
    return {"base": base, "sql": build_lora_adapter(base, root / "sql", r=8, seed=1),
            "chat": build_lora_adapter(base, root / "chat", r=4, target_modules=["q_proj", "v_proj"], seed=2),
            "late": build_lora_adapter(base, root / "late", r=8, seed=3)}


def offline_texts(models: dict[str, str]) -> dict[str | None, str]:
    llm = LLM(models["base"], dtype="float32", max_model_len=256, seed=0, enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [None, "sql", "chat", "late"]
    outs = llm.generate([PROMPT] * len(names), params, use_tqdm=False,
                        lora_request=[LoRARequest(n, i + 1, models[n]) if n else None for i, n in enumerate(names)])
    llm.shutdown()
    return {name: out.outputs[0].text for name, out in zip(names, outs)}


def complete(client: openai.OpenAI, model: str) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert response.model == model
    return response.choices[0].text


def test_server_serves_adapters_by_model_name(models: dict[str, str], tmp_path: Path) -> None:
    want = offline_texts(models)
    server = RemoteServer(models["base"], tmp_path, [
        "--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating",
        "--lora-modules", f"sql={models['sql']}", json.dumps({"name": "chat", "path": models["chat"]})])
    try:
        client = server.client()
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "sql", "chat"}
        assert cards["sql"].model_extra["parent"] == "tiny" and cards["chat"].model_extra["parent"] == "tiny"

        got = {name: complete(client, model) for name, model in ((None, "tiny"), ("sql", "sql"), ("chat", "chat"))}
        assert got == {k: want[k] for k in got}  # the offline engine's text under the same adapter
        assert len(set(got.values())) > 1  # adapters change the output
        chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=4, temperature=0.0)
        assert chat.model == "chat" and chat.choices[0].message.content is not None

        # runtime load / unload, and the refusals, OpenAI-shaped
        bad = server.post("/v1/load_lora_adapter", {"lora_name": "nope", "lora_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        empty = server.post("/v1/load_lora_adapter", {"lora_name": "", "lora_path": models["late"]})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "lora_name"
        dup = server.post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": models["late"]})
        assert dup.status_code == 400 and "already been loaded" in dup.json()["error"]["message"]
        ok = server.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": models["late"]})
        assert ok.status_code == 200, ok.text
        assert "late" in {m.id for m in client.models.list().data}
        assert complete(client, "late") == want["late"]
        assert server.post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
        gone = server.post("/v1/unload_lora_adapter", {"lora_name": "late"})
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="late", prompt=PROMPT, max_tokens=2)

        metrics = server.get("/metrics").text
        assert "pagedllm:lora_requests_info" in metrics
        assert 'pagedllm:lora_requests_total{lora_name="sql"' in metrics
        server.assert_healthy()
    finally:
        server.terminate()


def test_runtime_updates_are_refused_without_the_flag(models: dict[str, str], tmp_path: Path) -> None:
    server = RemoteServer(models["base"], tmp_path, ["--enable-lora"])
    try:
        response = server.post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": models["sql"]})
        assert response.status_code == 404
        assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]
        assert {m.id for m in server.client().models.list().data} == {"tiny"}
    finally:
        server.terminate()


def test_vllms_environment_switch_allows_runtime_updates(models: dict[str, str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM's docs set it, turns the endpoints on like the flag."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    server = RemoteServer(models["base"], tmp_path, ["--enable-lora"])
    try:
        response = server.post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": models["sql"]})
        assert response.status_code == 200, response.text
    finally:
        server.terminate()
