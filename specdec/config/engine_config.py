"""``EngineConfig``, the engine's validated configuration, its choice tables, and
``executor_backend``."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from specdec.config.checks import check_int, one_of
from specdec.config.kv_events import KVEventsConfig
from specdec.config.speculative import SpeculativeConfig
from specdec.errors import ConfigError

logger = logging.getLogger("specdec.config")

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's and llama.cpp's other spellings
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "f32": "float32", "half": "float16",
                 "fp16": "float16", "f16": "float16", "bf16": "bfloat16"}  # fmt: skip
DEVICES = ("cpu", "cuda")
DEVICE_ALIASES: dict[str, str] = {}  # "auto": EngineConfig picks cuda or cpu
KERNELS = ("auto", "native", "torch")
QUANTIZATIONS = ("auto", "fp32", "q8_0", "q4_0", "q4_1")
QUANTIZATION_ALIASES = {"gguf": "auto", "none": "auto"}  # vLLM's name for a GGUF file's own
ACTIVATION_DTYPES = ("auto", "float32", "int8", "bf16x2")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# llama.cpp's (-ctk / -ctv) and vLLM's short spellings
KV_CACHE_DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "f16": "float16",
                          "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                          "q8_0": "int8", "i8": "int8"}  # fmt: skip


@dataclass
class EngineConfig:
    """The engine's validated configuration (``EngineArgs.create_engine_config`` builds it from
    what users type; EngineArgs documents every field)."""

    model: str
    tokenizer: str | None = None  # a tokenizer folder / tokenizer.json instead of the model's
    dtype: str = "auto"
    device: str = "cpu"
    kernels: str = "auto"  # "auto" | "native" | "torch"
    quantization: str = "auto"  # "auto" (the file's own) | "fp32" | "q8_0" | "q4_0" | "q4_1"
    # "auto" (int8 where the CPU runs the 8-bit kernels natively) | "float32" | "int8"
    activation_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    # while requests decode, prompt reading may add at most this times their step time (<= 0: off)
    prefill_time_share: float = 1.0
    seed: int = 0
    kv_cache_memory: float | None = None  # bytes (> 1) or a fraction of available RAM (<= 1)
    enable_prefix_caching: bool = True  # reuse the KV of earlier requests' shared prefixes
    # KV cache element type: "auto" (float16 on the native CPU kernels, else the model's dtype)
    # | "float32" | "float16" | "bfloat16"
    kv_cache_dtype: str = "auto"
    threads: int | None = None  # torch (and native kernel) threads; None: torch's choice
    # tensor parallelism (issue 31): ranks running the target, how they run ("uni" | "mp"; "mp"
    # when the size is above 1), and each rank's cores ("0-31|32-63"; None: split evenly)
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    cpu_binding: str | None = None
    # fixed-shape forwards (worker/static_runner.py); None: on for device cuda
    static_shapes: bool | None = None
    enforce_eager: bool = False  # no CUDA graphs
    speculative: SpeculativeConfig | None = None
    # KV-cache events for external routers (KVEventsConfig, a dict or its JSON; None: off), and
    # this engine's replica index (labels its events and offsets their ports)
    kv_events_config: KVEventsConfig | dict | str | None = None
    data_parallel_rank: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = one_of("dtype", self.dtype, DTYPES, DTYPE_ALIASES)
        if self.device == "auto":  # vLLM's: the GPU when there is one
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = one_of("device", self.device, DEVICES, DEVICE_ALIASES)
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    "device cuda: torch sees no CUDA GPU here (torch "
                    f"{torch.__version__}); use device cpu, or auto"
                )
        self.kernels = one_of("kernels", self.kernels, KERNELS, {})
        self.quantization = one_of(
            "quantization", self.quantization, QUANTIZATIONS, QUANTIZATION_ALIASES
        )
        self.activation_dtype = one_of(
            "activation_dtype", self.activation_dtype, ACTIVATION_DTYPES, {}
        )
        self.kv_cache_dtype = one_of(
            "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES, KV_CACHE_DTYPE_ALIASES
        )
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 16)
        share = self.prefill_time_share
        if (
            isinstance(share, bool)
            or not isinstance(share, (int, float))
            or not math.isfinite(share)
            or share < 0
        ):
            raise ConfigError(f"prefill_time_share must be a number >= 0, got {share!r}")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 16)
        if self.threads is not None:
            check_int("threads", self.threads, 1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        self._check_parallel()
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if self.kv_cache_memory is not None and not (
            isinstance(self.kv_cache_memory, (int, float)) and self.kv_cache_memory > 0
        ):
            raise ConfigError(
                f"kv_cache_memory must be > 0 (bytes, or a fraction <= 1), got {self.kv_cache_memory}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}"
            )
        self.kv_events_config = KVEventsConfig.from_any(self.kv_events_config)
        check_int("data_parallel_rank", self.data_parallel_rank, 0)

    def _warn_oversubscribed(self) -> None:
        """More ranks than usable cores: they share cores and run slower than one rank."""
        import os

        size = self.tensor_parallel_size
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        if size > 1 and self.cpu_binding is None and size > cores:
            logger.warning(
                "tensor_parallel_size %d is more ranks than this machine's %d usable cores: they "
                "share cores and decode slower than one rank; use at most %d",
                size, cores, cores,
            )  # fmt: skip

    def _check_parallel(self) -> None:
        """The executor backend and the CPU binding (the heads are checked at load)."""
        backend = executor_backend(self)
        self._warn_oversubscribed()
        self.distributed_executor_backend = backend
        if self.device != "cpu" and self.tensor_parallel_size > 1:
            raise ConfigError("tensor_parallel_size above 1 runs on device cpu only")
        if self.cpu_binding is not None or self.tensor_parallel_size > 1:
            from specdec.distributed.binding import parse_cpu_binding

            parse_cpu_binding(self.cpu_binding, self.tensor_parallel_size)


def executor_backend(config: EngineConfig) -> str:
    """The executor backend that runs ``config``'s target (one of ``EXECUTOR_BACKENDS``): its
    ``distributed_executor_backend``, by default ``mp`` above one rank; always ``uni`` at one
    rank. An unknown name, ``ray`` without Ray, or ``uni`` for several ranks is a
    ``ConfigError``. The one place the choice is made (validation, then the executor)."""
    backend = config.distributed_executor_backend
    size = config.tensor_parallel_size
    if backend is None:
        backend = "mp" if size > 1 else "uni"
    if backend not in EXECUTOR_BACKENDS:
        raise ConfigError(
            f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
            f"got {backend!r}"
        )
    if backend == "ray" and size > 1:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "distributed_executor_backend ray needs Ray: pip install 'specdec[ray]'"
            )
    if backend == "uni" and size > 1:
        raise ConfigError(
            "distributed_executor_backend uni runs one rank; use mp for "
            f"tensor_parallel_size {size}"
        )
    # NOTE: one rank runs in-process whatever the backend (vLLM's guides pass "mp" at TP 1)
    return backend if size > 1 else "uni"
