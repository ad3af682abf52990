"""The live KV-cache page: `GET /kv-cache/state` (JSON) and `GET /kv-cache` (one self-contained HTML page).

The state is taken by the engine core between two steps (a utility call to
EngineCore.get_kv_cache_snapshot), so block tables, reference counts and free counts always agree; only
the copy runs there, the JSON is built in a worker thread of the API process. The state is behind the
API key like the rest of the API. The page itself is static and holds no data, so it is served without
the key: it reads the key from `?api_key=` (or asks for it) and sends it as a Bearer header on its own
requests.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.entrypoints.openai.serving_engine import APIError

PAGE_PATH = "/kv-cache"
STATE_PATH = "/kv-cache/state"


@cache
def page_html() -> str:
    """The page, shipped as package data next to this module."""
    return resources.files("pagedllm.entrypoints.openai").joinpath("static/kv_cache.html").read_text("utf-8")


def kv_cache_router(engine: Any, verify_api_key: Callable[[Request], Awaitable[None]],
                    model_name: str = "") -> APIRouter:
    """The page's two routes; `verify_api_key` guards the state only."""
    router = APIRouter()

    @router.get(PAGE_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def kv_cache_page() -> HTMLResponse:
        # no-store: an upgraded server's page is never shadowed by a stale copy
        return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})

    @router.get(STATE_PATH, dependencies=[Depends(verify_api_key)])
    async def kv_cache_state() -> Response:
        try:
            snapshot = await engine.get_kv_cache_snapshot()
        except EngineDeadError as exc:
            raise APIError(503, "The engine is not running.") from exc

        def render() -> bytes:
            return json.dumps({"model": model_name, **snapshot.to_dict()}, separators=(",", ":")).encode()

        body = await run_in_threadpool(render)
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    return router
