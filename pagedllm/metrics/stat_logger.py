"""A periodic one-line summary of the engine, as vLLM's server logs it: prompt and generation
throughput since the last line, running and waiting requests, KV cache usage, prefix-cache hits."""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("pagedllm.stats")

DEFAULT_LOG_INTERVAL_S = 5.0


class LoggingStatLogger:
    """Call `maybe_log(engine)` from the thread that steps the engine (it reads engine state)."""

    def __init__(self, interval_s: float = DEFAULT_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.last_time = time.monotonic()
        self.last_prompt_tokens = 0
        self.last_generation_tokens = 0
        self.last_queries = 0
        self.last_hits = 0
        self.active_since_last_line = False

    def maybe_log(self, engine: Any, idle: bool = False) -> bool:
        """Log a line once the interval has passed while there was work, and once more when the engine
        goes idle after work (so the last throughput is not left unreported). True if it logged."""
        now = time.monotonic()
        if engine.has_unfinished_requests():
            self.active_since_last_line = True
        if not self.active_since_last_line or (now - self.last_time < self.interval_s and not idle):
            return False
        self.log(engine, now)
        return True

    def log(self, engine: Any, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.last_time, 1e-9)
        kv = engine.kv_cache_manager
        prompt = engine.num_prompt_tokens - self.last_prompt_tokens
        generation = engine.num_generation_tokens - self.last_generation_tokens
        queries = kv.prefix_cache_queries - self.last_queries
        hits = kv.prefix_cache_hits - self.last_hits
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    prompt / elapsed, generation / elapsed, engine.scheduler.num_running,
                    len(engine.scheduler.waiting), 100 * kv.usage(), 100 * hits / queries if queries else 0.0)
        self.last_time = now
        self.last_prompt_tokens = engine.num_prompt_tokens
        self.last_generation_tokens = engine.num_generation_tokens
        self.last_queries, self.last_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        self.active_since_last_line = engine.has_unfinished_requests()
