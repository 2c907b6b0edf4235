"""The KV cache's engine arguments: element type, memory budget (and vLLM's names for it),
prefix caching, KV events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.config.arg_spec import ALIAS, _arg, human_int, json_value
from specdec.config.engine_config import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES


@dataclass
class CacheArgs:
    """The KV cache."""

    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache element type: float16 (half the memory; llama.cpp's default f16), float32 "
        "(transformers' arithmetic), bfloat16 (torch kernels only), int8 (native kernels: 8-bit "
        "entries with a scale per position and head, ~half float16's bytes; llama.cpp's q8_0); "
        "auto: float16 on the native CPU kernels, else the model's dtype",
        choices=KV_CACHE_DTYPES,
        aliases=KV_CACHE_DTYPE_ALIASES,
    )
    kv_cache_memory: float | None = _arg(
        None, "KV pool budget: bytes, or a fraction (<= 1) of available RAM", type=float
    )
    enable_prefix_caching: bool = _arg(
        True, "reuse the KV of earlier requests' shared prompt prefixes", type=bool
    )
    kv_events_config: Any = _arg(
        None,
        "KV-cache events for prefix-aware routers, vLLM's keys as JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (README: KV events '
        "for external routers)",
        type=json_value,
    )
    # -- vLLM's name for kv_cache_memory as a fraction
    gpu_memory_utilization: float | None = _arg(
        None, "vLLM: --kv-cache-memory as a fraction of available RAM", type=float, kind=ALIAS
    )
    kv_cache_memory_bytes: int | None = _arg(
        None, "vLLM: --kv-cache-memory in bytes", type=human_int, kind=ALIAS
    )
