"""`pagedllm router`: an OpenAI-compatible front for disaggregated prefill and decode.

Each /v1/completions or /v1/chat/completions request goes first to a prefill instance (a server run
with kv_role kv_producer or kv_both) as the same request cut to one token, not streamed, with
kv_transfer_params {"do_remote_decode": true}: that instance computes the prompt and keeps its KV
blocks. Its response's kv_transfer_params then go, with the client's original request, to a decode
instance (kv_consumer or kv_both), which pulls the blocks it does not already hold and generates the
whole answer, first token included; its response (streamed or not, usage counting the whole request)
is what the client gets, byte for byte. The flow and field names are vLLM's disaggregated-serving
proxy's.

Failure: a prefill instance that cannot be reached or answers 5xx is taken out of rotation and the
decode instance computes the prompt itself (counted in pagedllm:kv_transfer_fallbacks_total; a
transfer that fails later is counted by the decode instance, which also recomputes); a decode instance
that cannot be reached is taken out of rotation and the request goes to the next one. A health loop
puts instances back once their /health answers again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedllm.entrypoints import port_number

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded")
# Fields that change the prompt's KV not at all but would cost the prefill instance work, or would
# end its one-token run early: dropped from the prefill request (the decode request keeps them).
PREFILL_DROPPED_FIELDS = ("stream_options", "stop", "min_tokens", "logprobs", "top_logprobs", "echo",
                          "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                          "max_completion_tokens")


@dataclass
class Instance:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = True
    in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0


class InstancePool:
    def __init__(self, urls: list[str], role: str, policy: str):
        self.instances = [Instance(url.rstrip("/"), role) for url in urls]
        self.policy = policy
        self._turn = itertools.count()

    def pick(self, exclude: set[str] = frozenset()) -> Instance | None:  # type: ignore[assignment]
        candidates = [i for i in self.instances if i.healthy and i.url not in exclude]
        if not candidates:
            return None
        if self.policy == "least_loaded":
            return min(candidates, key=lambda i: (i.in_flight, i.num_requests))
        return candidates[next(self._turn) % len(candidates)]


def _error(status: int, message: str, kind: str = "server_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request cut to computing the prompt and one token, asking the instance to keep the
    prompt's blocks for a decode instance."""
    cut = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    cut.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    return cut


class Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], policy: str = "round_robin",
                 request_timeout_s: float = 600.0, health_interval_s: float = 2.0):
        if not decode_urls:
            raise ValueError("--decode needs at least one URL.")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}.")
        self.prefill = InstancePool(prefill_urls, "prefill", policy)
        self.decode = InstancePool(decode_urls, "decode", policy)
        self.request_timeout_s = request_timeout_s
        self.health_interval_s = health_interval_s
        self.client: httpx.AsyncClient | None = None
        self.num_requests = 0
        self.num_fallbacks = 0  # prefill unavailable: the decode instance computed the prompt

    @property
    def instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    def _mark_dead(self, instance: Instance, why: object) -> None:
        if instance.healthy:
            logger.warning("%s instance %s out of rotation: %s", instance.role, instance.url, why)
        instance.healthy = False
        instance.num_failures += 1

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for instance in self.instances:
                if instance.healthy:
                    continue
                try:
                    response = await self.client.get(f"{instance.url}/health", timeout=2.0)  # type: ignore[union-attr]
                except httpx.HTTPError:
                    continue
                if response.status_code == 200:
                    logger.info("%s instance %s back in rotation", instance.role, instance.url)
                    instance.healthy = True

    async def _prefill(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, Response | None]:
        """(kv_transfer_params from a prefill instance or None, or a client error to return as is)."""
        tried: set[str] = set()
        while (instance := self.prefill.pick(tried)) is not None:
            tried.add(instance.url)
            instance.in_flight += 1
            instance.num_requests += 1
            try:
                response = await self.client.post(f"{instance.url}{path}", json=prefill_body(body),  # type: ignore[union-attr]
                                                  timeout=self.request_timeout_s)
            except httpx.HTTPError as exc:
                self._mark_dead(instance, exc)
                continue
            finally:
                instance.in_flight -= 1
            if 400 <= response.status_code < 500:  # the request itself is bad: the decode side would say so too
                return None, Response(response.content, response.status_code,
                                      media_type=response.headers.get("content-type"))
            if response.status_code != 200:
                self._mark_dead(instance, f"HTTP {response.status_code}")
                continue
            return response.json().get("kv_transfer_params"), None
        if self.prefill.instances:
            self.num_fallbacks += 1
        return None, None

    async def handle(self, path: str, raw_request: Request) -> Response:
        try:
            body = json.loads(await raw_request.body())
        except json.JSONDecodeError as exc:
            return _error(400, f"the request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object.", "invalid_request_error")
        self.num_requests += 1
        kv_transfer_params, client_error = await self._prefill(path, body)
        if client_error is not None:
            return client_error
        decode_body = dict(body)
        if kv_transfer_params:
            decode_body["kv_transfer_params"] = kv_transfer_params
        tried: set[str] = set()
        while (instance := self.decode.pick(tried)) is not None:
            tried.add(instance.url)
            request = self.client.build_request("POST", f"{instance.url}{path}", json=decode_body,  # type: ignore[union-attr]
                                                timeout=self.request_timeout_s)
            instance.in_flight += 1
            instance.num_requests += 1
            try:
                response = await self.client.send(request, stream=True)  # type: ignore[union-attr]
            except httpx.HTTPError as exc:
                instance.in_flight -= 1
                self._mark_dead(instance, exc)
                continue
            return StreamingResponse(self._relay(instance, response), status_code=response.status_code,
                                     media_type=response.headers.get("content-type"))
        return _error(503, "no decode instance is reachable.")

    async def _relay(self, instance: Instance, response: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:  # the decode instance died mid-answer
            self._mark_dead(instance, exc)
            raise
        finally:
            instance.in_flight -= 1
            await response.aclose()

    def collect_metrics(self) -> list[Any]:
        requests = CounterMetricFamily("pagedllm:router_requests", "requests sent to each instance",
                                       labels=["role", "instance"])
        failures = CounterMetricFamily("pagedllm:router_instance_failures", "failed calls to each instance",
                                       labels=["role", "instance"])
        healthy = GaugeMetricFamily("pagedllm:router_instance_healthy", "1 while in rotation",
                                    labels=["role", "instance"])
        in_flight = GaugeMetricFamily("pagedllm:router_requests_in_flight", "requests each instance is serving",
                                      labels=["role", "instance"])
        for i in self.instances:
            requests.add_metric([i.role, i.url], i.num_requests)
            failures.add_metric([i.role, i.url], i.num_failures)
            healthy.add_metric([i.role, i.url], int(i.healthy))
            in_flight.add_metric([i.role, i.url], i.in_flight)
        total = CounterMetricFamily("pagedllm:router_client_requests", "requests from clients")
        total.add_metric([], self.num_requests)
        fallbacks = CounterMetricFamily("pagedllm:kv_transfer_fallbacks",
                                        "requests whose prompt the decode instance computed (no prefill instance)")
        fallbacks.add_metric([], self.num_fallbacks)
        return [requests, failures, healthy, in_flight, total, fallbacks]


class _RouterCollector:
    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        yield from self.router.collect_metrics()


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        router.client = httpx.AsyncClient(limits=limits)
        health = asyncio.create_task(router.health_loop())
        yield
        health.cancel()
        await router.client.aclose()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    registry = CollectorRegistry()
    registry.register(_RouterCollector(router))  # type: ignore[arg-type]

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await router.handle("/v1/completions", raw_request)

    @app.post("/v1/chat/completions")
    async def chat(raw_request: Request) -> Response:
        return await router.handle("/v1/chat/completions", raw_request)

    @app.get("/v1/models")
    async def models() -> Response:
        for instance in router.decode.instances:
            if instance.healthy:
                try:
                    response = await router.client.get(f"{instance.url}/v1/models", timeout=10.0)  # type: ignore[union-attr]
                except httpx.HTTPError as exc:
                    router._mark_dead(instance, exc)
                    continue
                return Response(response.content, response.status_code, media_type="application/json")
        return _error(503, "no decode instance is reachable.")

    @app.get("/health")
    async def health() -> Response:
        ok = any(i.healthy for i in router.decode.instances)
        body = {"status": "ok" if ok else "unavailable",
                "instances": [{"url": i.url, "role": i.role, "healthy": i.healthy, "in_flight": i.in_flight}
                              for i in router.instances]}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "router", help="OpenAI-compatible front for disaggregated prefill and decode instances",
        description="Send each request's prompt to a prefill instance, then the request with the KV "
                    "transfer params to a decode instance, and stream the decode instance's answer.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    parser.add_argument("--prefill", nargs="*", default=[], metavar="URL",
                        help="prefill instances (pagedllm serve --kv-transfer-config '{\"kv_role\": \"kv_producer\"}')")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode instances (pagedllm serve --kv-transfer-config '{\"kv_role\": \"kv_consumer\"}')")
    parser.add_argument("--policy", default="round_robin", choices=POLICIES,
                        help="how an instance is picked among the healthy ones of its role")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per call to an instance")
    parser.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between health checks of instances out of rotation")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import uvicorn

    router = Router(args.prefill, args.decode, args.policy, args.request_timeout, args.health_interval)
    logger.info("router on %s:%d: prefill %s, decode %s (%s)", args.host, args.port, args.prefill, args.decode,
                args.policy)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
    return 0
