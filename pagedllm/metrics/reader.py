"""Metric snapshots returned by `LLM.get_metrics()` (vLLM's shape: a list of named values)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    pass


@dataclass
class Gauge(Metric):
    pass


@dataclass
class Histogram(Metric):
    """`value` is the sum of observations; bucket_counts[i] counts those <= buckets[i] and above the
    bound before (non-cumulative), the last entry those above every bound."""

    buckets: list[float] = field(default_factory=list)
    bucket_counts: list[int] = field(default_factory=list)
    count: int = 0


def as_dict(metrics: list[Metric]) -> dict[str, float]:
    """name -> value, with labelled series summed (handy in tests and scripts)."""
    result: dict[str, float] = {}
    for metric in metrics:
        result[metric.name] = result.get(metric.name, 0) + metric.value
    return result
