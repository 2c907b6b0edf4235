"""``KVEventsConfig``: vLLM's ``kv_events_config``, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from specdec.config.checks import check_int, json_option, short
from specdec.errors import ConfigError

KV_EVENTS_PUBLISHERS = ("null", "zmq")
KV_EVENTS_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class KVEventsConfig:
    """vLLM's ``kv_events_config``: KV-cache events for prefix-aware routers, published over ZMQ
    (``specdec.engine.kv_events``). ``block_size`` is ours: the tokens per logical block."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"  # PUB socket: bound with a wildcard host, else connected
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread (then oldest dropped)
    topic: str = ""
    block_size: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                "kv_events_config.enable_kv_cache_events must be true or false, got "
                f"{self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in KV_EVENTS_PUBLISHERS:
            raise ConfigError(
                f"kv_events_config.publisher must be one of {', '.join(KV_EVENTS_PUBLISHERS)}, "
                f"got {self.publisher!r}"
            )
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if key == "replay_endpoint" and value is None:
                continue
            if not isinstance(value, str) or not value.startswith(KV_EVENTS_SCHEMES):
                raise ConfigError(
                    f"kv_events_config.{key} must be a ZMQ address starting with "
                    f"{', '.join(KV_EVENTS_SCHEMES)}, got {value!r}"
                )
        for key, minimum in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1),
                             ("block_size", 1)):  # fmt: skip
            check_int(f"kv_events_config.{key}", getattr(self, key), minimum)
        if not isinstance(self.topic, str):
            raise ConfigError(f"kv_events_config.topic must be a string, got {self.topic!r}")
        if self.active:
            import importlib.util

            for module, package in (("zmq", "pyzmq"), ("msgpack", "msgpack")):
                if importlib.util.find_spec(module) is None:
                    raise ConfigError(
                        f"kv_events_config.publisher zmq needs {package}: pip install {package}"
                    )

    @property
    def active(self) -> bool:
        """Whether events are gathered and published at all."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_any(cls, value: Any) -> KVEventsConfig | None:
        """A KVEventsConfig, a dict of vLLM's keys, their JSON, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = json_option("kv_events_config", value)
        if not isinstance(value, dict):
            raise ConfigError(f"kv_events_config must be a JSON object, got {short(value)}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ConfigError(
                f"unknown kv_events_config key(s) {', '.join(unknown)}; allowed: "
                + ", ".join(allowed)
            )
        return cls(**value)
