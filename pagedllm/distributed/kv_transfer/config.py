"""KVTransferConfig: `--kv-transfer-config` / `LLM(kv_transfer_config=...)`, with vLLM's key names.

Every key but `kv_role` is optional, with defaults that work on one machine: the producer serves its
blocks on 127.0.0.1:14579 (vLLM's default kv_port), so two instances on one host need distinct ports.
Unknown keys are rejected rather than ignored.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("ZmqConnector",)
DEFAULT_KV_PORT = 14579


@dataclass
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "ZmqConnector"
    # Where a producer serves its blocks (consumers learn it from each request's kv_transfer_params).
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Producer: most bytes of saved blocks held for consumers to pull (oldest dropped past it).
    kv_buffer_size: int = 2 * 2**30
    # transfer_timeout_s: a consumer gives up on a pull after this long and recomputes the prompt.
    # staging_ttl_s: a producer drops saved blocks no consumer pulled within this long.
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    EXTRA_KEYS = {"transfer_timeout_s": 30.0, "staging_ttl_s": 120.0}

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}.")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {list(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}.")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a TCP port in [1, 65535], got {self.kv_port!r}.")
        if not isinstance(self.kv_buffer_size, int) or self.kv_buffer_size <= 0:
            raise ValueError(f"kv_transfer_config.kv_buffer_size must be a positive number of bytes, "
                             f"got {self.kv_buffer_size!r}.")
        extra = dict(self.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(self.EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {unknown}; "
                             f"known: {sorted(self.EXTRA_KEYS)}.")
        for key, default in self.EXTRA_KEYS.items():
            value = extra.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} must be a positive "
                                 f"number of seconds, got {value!r}.")
            extra[key] = float(value)
        self.kv_connector_extra_config = extra

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transfer_timeout_s(self) -> float:
        return self.kv_connector_extra_config["transfer_timeout_s"]

    @property
    def staging_ttl_s(self) -> float:
        return self.kv_connector_extra_config["staging_ttl_s"]

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """A config object, a dict, or its JSON text (as given on the command line)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}.")
        if "kv_role" not in value:
            raise ValueError(f"kv_transfer_config needs kv_role, one of {list(KV_ROLES)}.")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: {sorted(names)}.")
        return cls(**value)
