"""Prometheus metrics for GET /metrics, named after vLLM's (`vllm:` becomes `pagedllm:`).

Two sources: the engine's own counters and gauges (requests running and waiting, KV cache usage,
token and prefix-cache counts), read from the engine core with engine.get_metrics() at scrape time so
/metrics is exact when it is read; and latency histograms, observed on the event loop as each step's
core outputs arrive (inter-token gaps, per sample) and from each finished sample's RequestMetrics
(TTFT, queue, end to end, on the core's clock).
Everything lives in a private CollectorRegistry, so two apps in one process never collide.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.core_types.engine_core import EngineCoreOutput

# vLLM's bucket boundaries, so the same dashboards read both
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineSnapshotCollector(Collector):
    """Exposes the engine's metrics as they were at the last snapshot (taken right before a scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: list[Any] = []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, tuple[CounterMetricFamily | GaugeMetricFamily, list[str]]] = {}
        for metric in self.snapshot:
            labels = {"model_name": self.model_name, **dict(metric.labels or {})}
            if type(metric).__name__ == "Histogram":  # the engine's own histograms (KV transfer times)
                yield _histogram_family(metric, labels)
                continue
            if metric.name not in families:
                is_counter = type(metric).__name__ == "Counter"
                cls = CounterMetricFamily if is_counter else GaugeMetricFamily
                kind = "counter" if is_counter else "gauge"
                families[metric.name] = (cls(metric.name, f"pagedllm engine {kind} {metric.name}",
                                             labels=list(labels)), list(labels))
            family, label_names = families[metric.name]
            family.add_metric([str(labels.get(name, "")) for name in label_names], float(metric.value))
        for family, _ in families.values():
            yield family


def _histogram_family(metric: Any, labels: dict[str, str]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(metric.name, f"pagedllm engine histogram {metric.name}", labels=list(labels))
    cumulative, buckets = 0, []
    for bound, count in zip([*metric.buckets, float("inf")], metric.bucket_counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    family.add_metric(list(labels.values()), buckets, metric.value)
    return family


class ServerMetrics:
    """Histograms fed from each step's core outputs (a StepObserver) plus the engine snapshot collector."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_collector = _EngineSnapshotCollector(model_name)
        self.registry.register(self._engine_collector)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name=model_name)

        self.time_to_first_token = histogram(
            "pagedllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "pagedllm:inter_token_latency_seconds", "Time between two steps that produced tokens for a "
            "request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "pagedllm:e2e_request_latency_seconds", "Time from arrival to the end of a finished request.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "pagedllm:request_queue_time_seconds", "Time from arrival to first being scheduled.",
            REQUEST_LATENCY_BUCKETS)
        # request id -> sample index -> when its last tokens came out
        self._last_token_time: dict[str, dict[int, float]] = {}
        self._scrape_lock = threading.Lock()

    # ---- StepObserver (event loop) ----------------------------------------------------------------

    def on_step(self, outputs: list[EngineCoreOutput], now: float) -> None:
        for output in outputs:
            samples = self._last_token_time.setdefault(output.request_id, {})
            if output.new_token_ids:
                previous = samples.get(output.index)
                if previous is not None:
                    self.inter_token_latency.observe(now - previous)
                samples[output.index] = now
            if output.finish_reason is not None:
                samples.pop(output.index, None)
                if not samples:
                    del self._last_token_time[output.request_id]
                self._observe_finished(output, now)

    def on_abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._last_token_time.pop(request_id, None)

    def _observe_finished(self, output: EngineCoreOutput, now: float) -> None:
        metrics = getattr(output, "metrics", None)
        arrival = getattr(metrics, "arrival_time", None)
        if arrival is None:
            return
        first_token = getattr(metrics, "first_token_time", None)
        first_scheduled = getattr(metrics, "first_scheduled_time", None)
        finished = getattr(metrics, "finished_time", None) or now
        if first_token is not None:
            self.time_to_first_token.observe(max(first_token - arrival, 0.0))
        if first_scheduled is not None:
            self.request_queue_time.observe(max(first_scheduled - arrival, 0.0))
        self.e2e_request_latency.observe(max(finished - arrival, 0.0))

    # ---- scrape (event loop) --------------------------------------------------------------------

    def render(self, engine_metrics: list[Any]) -> bytes:
        """The Prometheus text for a scrape, with the engine's metrics as just read."""
        with self._scrape_lock:  # the snapshot is shared by concurrent scrapes
            self._engine_collector.snapshot = list(engine_metrics)
            return generate_latest(self.registry)
