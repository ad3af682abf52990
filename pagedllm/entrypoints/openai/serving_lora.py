"""LoRA adapters over the OpenAI API, as vLLM serves them.

- `--lora-modules sql=/path/a chat=/path/b` (or vLLM's JSON form '{"name": ..., "path": ...,
  "base_model_name": ...}') registers adapters at start-up; each is checked against the model there.
- A request's `model` field names the base model or an adapter; /v1/models lists the adapters with the
  base model as their `parent`.
- With `--allow-runtime-lora-updating`, POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
  /v1/unload_lora_adapter {"lora_name"} add and remove adapters while serving (otherwise both answer
  404). Errors are OpenAI-shaped: 400 for a bad or duplicate adapter, 404 for an unknown one.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.entrypoints.openai.serving_engine import APIError
from pagedllm.lora.request import LoRARequest


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """--lora-modules entries: `name=path` or a JSON object with name, path (and base_model_name)."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({error}).") from None
            if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
                raise ValueError(f"--lora-modules: {value!r} needs \"name\" and \"path\".")
            modules.append(LoRAModulePath(str(spec["name"]), str(spec["path"]), spec.get("base_model_name")))
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} must be NAME=PATH or a JSON object.")
            modules.append(LoRAModulePath(name, path))
    return modules


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRARegistry:
    """The adapters this server serves, by the name clients use as `model`."""

    def __init__(self, engine: Any, base_model_names: list[str]):
        self.engine = engine
        self.base_model_names = base_model_names
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return getattr(self.engine.model_config, "lora_config", None) is not None

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter against the model and register it; ValueError naming the problem."""
        if not self.enabled:
            raise ValueError("LoRA adapters need the server started with --enable-lora.")
        if name in self.adapters or name in self.base_model_names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        request = LoRARequest(name, next(self._ids), path,
                              base_model_name=base_model_name or self.base_model_names[0])
        self.engine.input_processor.validate_lora(request)
        self.adapters[name] = request
        return request

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None


def lora_router(registry: LoRARegistry, allow_runtime_updates: bool,
                verify_api_key: Callable[..., Awaitable[None]]) -> APIRouter:
    router = APIRouter(dependencies=[Depends(verify_api_key)])

    def check_allowed() -> None:
        if not allow_runtime_updates:
            raise APIError(404, "Runtime LoRA updates are off: start the server with "
                                "--allow-runtime-lora-updating to load and unload adapters.")

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        check_allowed()
        try:
            request = registry.add(body.lora_name, body.lora_path)
        except ValueError as error:
            param = "lora_name" if str(error).startswith("lora_name") or "already been loaded" in str(error) \
                else "lora_path"
            raise APIError(400, str(error), param=param) from error
        try:  # read into the engine's CPU cache now, not in the first step that runs it
            await registry.engine.call_utility("add_lora", request)
        except Exception as error:
            registry.adapters.pop(request.lora_name, None)
            raise APIError(400, f"Loading lora adapter '{body.lora_name}' failed: {error}",
                           param="lora_path") from error
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        check_allowed()
        request = registry.adapters.pop(body.lora_name, None)
        if request is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
        await registry.engine.call_utility("remove_lora", request.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
