"""Engine configuration, validated on creation."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from specdec.errors import ConfigError
from specdec.methods import METHODS, canonical_method
from specdec.model.registry import ALIASES, DEFAULT_MODEL

if TYPE_CHECKING:
    from pathlib import Path

    from specdec.model.hub import HubOptions

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# vLLM speculative_config keys about GPU execution (batch padding, kernels, block hashing,
# distributed drafting): accepted and logged once, they change nothing here.
VLLM_IGNORED_KEYS = (
    "disable_padded_drafter_batch", "disable_eagle_block_drop", "disable_lookahead_block_hashes",
    "enforce_eager", "attention_backend", "moe_backend", "index_share_for_mtp_iteration",
    "use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting",
    "draft_load_config", "code_revision", "max_model_len", "kv_cache_dtype",
    "draft_lm_head_quantization", "num_speculative_tokens_per_batch_size", "disable_log_stats",
    "disable_logprobs", "acceptance_method", "rejection_sample_method",
    "enable_adaptive_verification",
)  # fmt: skip
logger = logging.getLogger("specdec.config")


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys."""

    method: str = "ngram"
    # None: 32 for suffix (vLLM's default: it sizes its own drafts, this is only the cap), else 5
    num_speculative_tokens: int | None = None
    model: str | None = None
    # the revision (branch, tag, commit) of a hub id in `model` (vLLM's key); None: main
    revision: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_tensor_parallel_size: int = 1
    disable_by_batch_size: int | None = None
    adaptive: bool = True  # choose k per request and step (num_speculative_tokens is the cap)
    num_draft_layers: int | None = None  # layer_skip; None = all but the last 2 (measured best)
    draft_quantization: str | None = None
    # how model drafters draft for a sampled request (vLLM's key): "greedy" (the argmax, a point
    # mass: output identical to plain sampling) or "probabilistic" (sampled from q, Leviathan/Chen
    # acceptance: same distribution, not the same text). ngram and suffix drafts are point masses.
    draft_sample_method: str = "greedy"
    # suffix decoding (vLLM's names and defaults): tree depth caps match + draft length; the global
    # tree caches this many finished responses (FIFO, 0 = off); draft length <= factor * match
    # length; tokens are drafted while their estimated probability stays >= min_token_prob.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # llama.cpp's --draft-min / --draft-p-min, the defaults of every request's
    # speculative_n_min / speculative_p_min (SamplingParams): fewer drafts than draft_min are not
    # verified; drafts whose draft probability q(x) is below draft_p_min are cut (drafters with q)
    draft_min: int = 0
    draft_p_min: float = 0.0

    def __post_init__(self) -> None:
        method = canonical_method(self.method) if isinstance(self.method, str) else None
        if method is None:
            raise ConfigError(
                f"unknown speculative_config.method {self.method!r}; allowed: "
                f"{', '.join(METHODS)} (and the aliases "
                f"{', '.join(a for m in METHODS.values() for a in m.aliases)})"
            )
        self.method = method
        info = METHODS[method]
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 32 if self.method == "suffix" else 5
        _check_int(self.num_speculative_tokens, "num_speculative_tokens", 1)
        _check_int(self.prompt_lookup_min, "prompt_lookup_min", 1)
        _check_int(self.prompt_lookup_max, "prompt_lookup_max", 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not isinstance(self.adaptive, bool):
            raise ConfigError(
                f"speculative_config.adaptive must be true or false, got {self.adaptive!r}"
            )
        if self.draft_tensor_parallel_size != 1:
            raise ConfigError("speculative_config.draft_tensor_parallel_size must be 1")
        if self.disable_by_batch_size is not None:
            _check_int(self.disable_by_batch_size, "disable_by_batch_size", 1)
        if self.num_draft_layers is not None:
            _check_int(self.num_draft_layers, "num_draft_layers", 1)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ConfigError(
                f"speculative_config.draft_sample_method must be one of "
                f"{', '.join(DRAFT_SAMPLE_METHODS)}, got {self.draft_sample_method!r}"
            )
        if self.draft_sample_method != "greedy" and not info.samples_q:
            q_methods = ", ".join(m for m, i in METHODS.items() if i.samples_q)
            raise ConfigError(
                f"speculative_config.draft_sample_method '{self.draft_sample_method}' applies to "
                f"drafters with a distribution ({q_methods}); '{self.method}' drafts are "
                "point masses"
            )
        if info.needs_model and not self.model:
            raise ConfigError(f"speculative_config.model is required for method '{self.method}'")
        _check_int(self.suffix_decoding_max_tree_depth, "suffix_decoding_max_tree_depth", 1)
        _check_int(
            self.suffix_decoding_max_cached_requests, "suffix_decoding_max_cached_requests", 0
        )
        _check_number(
            self.suffix_decoding_max_spec_factor, "suffix_decoding_max_spec_factor", 0.0, None
        )
        _check_number(
            self.suffix_decoding_min_token_prob, "suffix_decoding_min_token_prob", 0.0, 1.0
        )
        _check_int(self.draft_min, "draft_min", 0)
        _check_number(self.draft_p_min, "draft_p_min", 0.0, 1.0)

    @classmethod
    def from_any(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """Accept a config, a dict of vLLM keys, or a JSON string."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        d = {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in d.items()}
        ignored = sorted(k for k in d if k in VLLM_IGNORED_KEYS)
        if ignored:
            logger.info("speculative_config: ignored on CPU: %s", ", ".join(ignored))
        for k in ignored:
            del d[k]
        tp = d.pop("tensor_parallel_size", 1)
        if tp != 1:
            raise ConfigError("speculative_config.tensor_parallel_size must be 1 (one device)")
        if "quantization" in d:
            d.setdefault("draft_quantization", d.pop("quantization"))
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ConfigError(
                f"unknown speculative_config key(s) {', '.join(unknown)}; allowed: "
                + ", ".join(sorted(allowed))
            )
        if "method" not in d:
            d["method"] = _infer_method(d.get("model"))
        if d.get("model") == "[ngram]":
            d["model"] = None
        return cls(**d)

    @classmethod
    def from_legacy(
        cls,
        speculative_model: str | None,
        num_speculative_tokens: int | None,
        ngram_prompt_lookup_max: int | None = None,
        ngram_prompt_lookup_min: int | None = None,
    ) -> SpeculativeConfig | None:
        """The older spellings: ``speculative_model="[ngram]"`` or a draft model path."""
        if speculative_model is None:
            return None
        d: dict[str, Any] = {"model": speculative_model}
        if num_speculative_tokens is not None:
            d["num_speculative_tokens"] = num_speculative_tokens
        if ngram_prompt_lookup_max is not None:
            d["prompt_lookup_max"] = ngram_prompt_lookup_max
        if ngram_prompt_lookup_min is not None:
            d["prompt_lookup_min"] = ngram_prompt_lookup_min
        return cls.from_dict(d)


def _infer_method(model: str | None) -> str:
    if model is None or model in ("[ngram]", "ngram"):
        return "ngram"
    if model in ("[layer_skip]", "layer_skip"):
        return "layer_skip"
    return "draft_model"


def _check_int(value: Any, key: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(
            f"speculative_config.{key} must be an integer >= {minimum}, got {value!r}"
        )


def _check_number(value: Any, key: str, minimum: float, maximum: float | None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"speculative_config.{key} must be a number {allowed}, got {value!r}")


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
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ConfigError(
                    f"kv_events_config.{key} must be an integer >= {minimum}, got {value!r}"
                )
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
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"kv_events_config is not valid JSON ({e.msg} at column {e.colno})"
                ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"kv_events_config must be a JSON object, got {_short(value)}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ConfigError(
                f"unknown kv_events_config key(s) {', '.join(unknown)}; allowed: "
                + ", ".join(allowed)
            )
        return cls(**value)


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


def _one_of(key: str, value: Any, allowed: tuple[str, ...], aliases: dict[str, str]) -> str:
    """``value`` (or its alias) checked against ``allowed``; the error names the key."""
    resolved = aliases.get(value, value) if isinstance(value, str) else value
    if resolved not in allowed:
        also = f" (or {', '.join(aliases)})" if aliases else ""
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}{also}, got {value!r}")
    return resolved


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
        self.dtype = _one_of("dtype", self.dtype, DTYPES, DTYPE_ALIASES)
        if self.device == "auto":  # vLLM's: the GPU when there is one
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = _one_of("device", self.device, DEVICES, DEVICE_ALIASES)
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    "device cuda: torch sees no CUDA GPU here (torch "
                    f"{torch.__version__}); use device cpu, or auto"
                )
        self.kernels = _one_of("kernels", self.kernels, KERNELS, {})
        self.quantization = _one_of(
            "quantization", self.quantization, QUANTIZATIONS, QUANTIZATION_ALIASES
        )
        self.activation_dtype = _one_of(
            "activation_dtype", self.activation_dtype, ACTIVATION_DTYPES, {}
        )
        self.kv_cache_dtype = _one_of(
            "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES, KV_CACHE_DTYPE_ALIASES
        )
        _check_engine_int("max_num_seqs", self.max_num_seqs, 1)
        _check_engine_int("max_num_batched_tokens", self.max_num_batched_tokens, 16)
        share = self.prefill_time_share
        if (
            isinstance(share, bool)
            or not isinstance(share, (int, float))
            or not math.isfinite(share)
            or share < 0
        ):
            raise ConfigError(f"prefill_time_share must be a number >= 0, got {share!r}")
        if self.max_model_len is not None:
            _check_engine_int("max_model_len", self.max_model_len, 16)
        if self.threads is not None:
            _check_engine_int("threads", self.threads, 1)
        _check_engine_int("tensor_parallel_size", self.tensor_parallel_size, 1)
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
        _check_engine_int("data_parallel_rank", self.data_parallel_rank, 0)

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


def _check_engine_int(key: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")


# ---- engine arguments: every option users type, declared once ----------------------------------

# What becomes of an argument:
ENGINE = "engine"  # an EngineConfig field of the same name
SPECULATIVE = "speculative"  # folded into the SpeculativeConfig (vLLM's older keys, llama.cpp's)
SINGLE = "single"  # a parallel size: 1 only (specdec runs on one device)
ALIAS = "alias"  # another name for an engine field (see EngineArgs.create_engine_config)
IGNORED = "ignored"  # a vLLM / llama.cpp option with no effect here: accepted, logged once
REFUSED = "refused"  # a vLLM option specdec cannot honour: its defaults only, else an error
SERVER = "server"  # read by `specdec serve` only
HUB = "hub"  # where a hub id's files come from (create_engine_config resolves ids to paths)

# --help's sections (entrypoints/arg_parser.py): section -> (what it holds, the vLLM config
# classes that map to it), in --help's order
HELP_SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "prompt": ("what `generate` runs and prints", ()),
    "model": ("model, weights, kernels", ("ModelConfig", "LoadConfig", "DeviceConfig")),
    "cache": ("the KV cache", ("CacheConfig",)),
    "scheduler": ("batching, prompt chunks", ("SchedulerConfig",)),
    "speculative": ("speculative decoding", ("SpeculativeConfig",)),
    "parallel": ("tensor parallelism, threads, replicas", ("ParallelConfig",)),
    "sampling": ("sampling (llama.cpp's spellings too)", ()),
    "structured": ("structured output, at most one", ("StructuredOutputsConfig",)),
    "server": ("the OpenAI-compatible server", ("FrontendArgs", "ObservabilityConfig")),
    "ray": ("Ray Serve (pip install 'specdec[ray]')", ()),
    "ignored": ("vLLM / llama.cpp flags without effect here, or at their defaults only",
                ("CompilationConfig", "LoRAConfig", "MultiModalConfig", "KVTransferConfig",
                 "KVEventsConfig", "ECTransferConfig", "EPLBConfig", "AttentionConfig",
                 "KernelConfig", "ProfilerConfig", "PoolerConfig")),
}  # fmt: skip
# the section of each argument: by kind, and for engine arguments by name
_KIND_SECTION = {SPECULATIVE: "speculative", SINGLE: "parallel", ALIAS: "cache",
                 IGNORED: "ignored", REFUSED: "ignored", SERVER: "server",
                 HUB: "model"}  # fmt: skip
_NAME_SECTION = {
    **dict.fromkeys(("model", "tokenizer", "dtype", "device", "kernels", "quantization",
                     "activation_dtype", "max_model_len", "seed", "enforce_eager",
                     "static_shapes", "generation_config", "override_generation_config"),
                    "model"),
    **dict.fromkeys(("kv_cache_dtype", "kv_cache_memory", "enable_prefix_caching",
                     "kv_events_config"), "cache"),
    **dict.fromkeys(("max_num_seqs", "max_num_batched_tokens", "prefill_time_share"),
                    "scheduler"),
    **dict.fromkeys(("threads", "tensor_parallel_size", "distributed_executor_backend",
                     "cpu_binding", "data_parallel_rank"), "parallel"),
}  # fmt: skip
# the arguments --help shows (the others under --help=SECTION / --help=all), with a short help
COMMON_ARGS = {
    "model": "an alias, a .gguf file, a Hugging Face folder or hub id",
    "dtype": "compute dtype",
    "quantization": "weight format: the file's own, or converted",
    "max_model_len": "context length (4096, 32k); default min(4096, the model's)",
    "kv_cache_dtype": "KV cache element type (auto: float16 on the native kernels)",
    "kv_cache_memory": "KV pool budget: bytes, or a fraction of RAM",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "max_num_seqs": "sequences decoded together",
    "max_num_batched_tokens": "tokens per step (longer prompts: in chunks)",
    "speculative_config": """vLLM's JSON: '{"method": "ngram"}', or --speculative-config.method ngram""",
    "model_draft": "llama.cpp: a draft model (method draft_model)",
    "draft_max": "llama.cpp: drafts per step",
    "tensor_parallel_size": "ranks running the target, each a shard",
    "threads": "CPU threads (llama.cpp's -t)",
}  # fmt: skip


def help_section(name: str) -> str:
    """The --help section of an EngineArgs field."""
    f = EngineArgs.__dataclass_fields__[name]
    return _NAME_SECTION.get(name) or _KIND_SECTION[f.metadata["kind"]]


def section_group(parser: argparse.ArgumentParser, name: str) -> Any:
    """The argument group of a --help section (made on first use)."""
    if name not in HELP_SECTIONS:
        raise KeyError(f"unknown help section {name!r}")
    for group in parser._action_groups:
        if getattr(group, "section", None) == name:
            return group
    group = parser.add_argument_group(name, HELP_SECTIONS[name][0])
    group.section = name  # type: ignore[attr-defined]
    return group


def common(action: argparse.Action, short: str | None = None) -> argparse.Action:
    """Show ``action`` in the short --help, with ``short`` as its help there."""
    action.common = True  # type: ignore[attr-defined]
    action.short_help = short  # type: ignore[attr-defined]
    return action


# why each SINGLE option must be 1 where it is refused
_SINGLE_WHY = {
    "pipeline_parallel_size": "there is no pipeline parallelism (tensor parallelism is "
    "--tensor-parallel-size)",
    "data_parallel_size": "replicas run behind `specdec serve --data-parallel-size N`; one "
    "process (generate, LLM, bench) holds one engine",
    "nnodes": "one engine runs on one machine (replicas across machines: --ray)",
    "decode_context_parallel_size": "there is no context parallelism",
    "prefill_context_parallel_size": "there is no context parallelism",
}


def _arg(
    default: Any,
    help: str,
    *,
    type: Any = str,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    aliases: dict[str, str] | None = None,
    kind: str = ENGINE,
    nargs: str | None = None,
    check: Callable[[Any], str | None] | None = None,
    note: str | None = None,
) -> Any:
    """A field of EngineArgs: its default, help, CLI type and extra flag spellings. ``nargs``:
    vLLM's list ("+") or optional-value ("?") flags; ``check``: the reason a given value is
    refused (None: accepted); ``note``: logged instead of "ignored" when the option is given."""
    meta = {"help": help, "type": type, "flags": flags, "choices": choices,
            "aliases": aliases or {}, "kind": kind, "nargs": nargs, "check": check,
            "note": note}  # fmt: skip
    return field(default=default, metadata=meta)


def _ignored(default: Any, help: str, **kw: Any) -> Any:
    """A vLLM option without effect here: accepted, logged once when given."""
    return _arg(default, help, kind=IGNORED, **kw)


def _only(*allowed: Any, why: str) -> Callable[[Any], str | None]:
    """Refuse every value but ``allowed`` (the option's defaults and harmless values)."""
    return lambda value: None if value in allowed else why


def _nothing(why: str) -> Callable[[Any], str | None]:
    """Refuse any non-empty value."""
    return lambda value: None if value in (None, "", {}, [], False) else why


def json_value(text: str) -> Any:
    """A JSON flag value (vLLM's dict options: --hf-overrides '{...}', -cc '{...}')."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno})") from None


def human_int(text: str) -> int:
    """vLLM's integer spellings: 4096, 32k (32000), 32K (32768), 1.5M."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)([kmgKMG]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096 or 32k, got {text!r}")
    number, unit = match.groups()
    value = float(number) * units.get(unit, 1)
    if not unit and "." in number or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


# why options are refused (their values would change the output, and specdec cannot honour them)
_ONE_MODEL = "specdec builds the model from its own config; it cannot override it"
_TEXT_ONLY = "specdec serves text generation only (no pooling, embedding or scoring models)"
_NO_LORA = "specdec loads no LoRA adapters"
_NO_PLUGINS = "specdec loads no Python plugins into the sampler"
# the generation_config.json keys vLLM reads for default sampling, as SamplingParams names
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty"}  # fmt: skip
# override_generation_config keys specdec applies (vLLM's names); max_tokens defaults are not
OVERRIDE_GENERATION_KEYS = (*GENERATION_CONFIG_KEYS, "presence_penalty", "frequency_penalty")
# structured_outputs_config keys that would change the output (the built-in engine always allows
# JSON whitespace and additional properties the schema allows)
_STRUCTURED_CHANGING = ("disable_any_whitespace", "disable_additional_properties")


def _only_harmless_structured(value: Any) -> str | None:
    """structured_outputs_config: the backend choice is ignored; output-changing keys refused."""
    if isinstance(value, dict):
        bad = [k for k in _STRUCTURED_CHANGING if value.get(k)]
        if bad:
            return f"{', '.join(bad)} cannot be honoured by the built-in grammar engine"
    return None


@dataclass
class EngineArgs:
    """Every engine option, declared once with its type, default, choices and help.

    ``LLM(**kwargs)``, the flags of ``specdec generate`` / ``serve`` / ``bench`` and the
    benchmarks' engine options all derive from it (``from_kwargs``, ``add_cli_args``,
    ``from_cli_args``); ``create_engine_config`` validates and resolves it into EngineConfig.
    vLLM's keyword arguments and server flags that mean nothing on this hardware are accepted
    and logged once ("ignored on CPU: ..."); a parallel size above 1 fails with a clear message.
    """

    model: str = _arg(
        DEFAULT_MODEL,
        "model: an alias, a .gguf file, a Hugging Face folder or hub id (org/name; a GGUF "
        "repository's file by quantization: org/name-GGUF:Q4_K_M, llama.cpp's -hf)",
        flags=("-m", "-hf", "-hfr", "--hf-repo"),
    )
    speculative_config: Any = _arg(
        None,
        "speculative decoding, vLLM's keys as JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 5}\'',
        flags=("-sc",),
        kind=SPECULATIVE,
    )
    tokenizer: str | None = _arg(
        None,
        "a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json) or its "
        "tokenizer.json, instead of the model's own; its vocabulary must fit the model's",
    )
    dtype: str = _arg(
        "auto",
        "compute dtype. auto: float32 activations on the native kernels (int8 for quantized "
        "weights where fast). bfloat16/float16 keep the native kernels under --kernels auto "
        "(the torch kernels they need decode ~10x slower; logged); --kernels torch honours them",
        choices=DTYPES,
        aliases=DTYPE_ALIASES,
    )
    device: str = _arg(
        "cpu", "cpu or cuda (auto: cuda where a GPU is, else cpu)", choices=("auto", *DEVICES),
        aliases=DEVICE_ALIASES,
    )  # fmt: skip
    kernels: str = _arg(
        "auto", "native (C++, batch-invariant) or torch; auto: native when built", choices=KERNELS
    )
    quantization: str = _arg(
        "auto",
        "weight format: the file's own (auto, vLLM's gguf), or converted to fp32/q8_0/q4_0/q4_1",
        choices=QUANTIZATIONS,
        aliases=QUANTIZATION_ALIASES,
        flags=("-q",),
    )
    activation_dtype: str = _arg(
        "auto",
        "int8: llama.cpp-style 8-bit activations for quantized weights (fast on AVX-512 VNNI and AVX2); "
        "bf16x2: activations as two bfloat16s on AMX-BF16 tiles for f16/bf16 weights (~2-3x "
        "faster prefill; f16 decode slower); float32: exact float activations (matches "
        "transformers); auto: int8 for quantized weights where fast, bf16x2 for bf16 weights "
        "on AMX-BF16 CPUs, else float32",
        choices=ACTIVATION_DTYPES,
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache element type: float16 (half the memory; llama.cpp's default f16), float32 "
        "(transformers' arithmetic), bfloat16 (torch kernels only), int8 (native kernels: 8-bit "
        "entries with a scale per position and head, ~half float16's bytes; llama.cpp's q8_0); "
        "auto: float16 on the native CPU kernels, else the model's dtype",
        choices=KV_CACHE_DTYPES,
        aliases=KV_CACHE_DTYPE_ALIASES,
    )
    max_model_len: int | None = _arg(
        None,
        "context length (prompt + output; 4096, 32k or 32K); default min(4096, the model's)",
        type=human_int,
        flags=("-c", "--ctx-size"),
    )
    max_num_seqs: int = _arg(
        8, "sequences decoded together (llama.cpp's -np/--parallel)", type=int,
        flags=("-np", "--parallel"),
    )  # fmt: skip
    max_num_batched_tokens: int = _arg(
        512,
        "tokens per step; longer prompts are prefilled in chunks of this size",
        type=human_int,
    )
    prefill_time_share: float = _arg(
        1.0,
        "while requests decode, the prompts read beside them may add at most this times their "
        "step time (1: their tokens come at most ~2x slower; higher favours throughput and "
        "time to first token; 0: no limit, prompts take the whole token budget)",
        type=float,
    )
    seed: int = _arg(
        0,
        "engine seed: requests without a seed draw theirs from it (llama.cpp's -s)",
        type=int,
        flags=("-s",),
    )
    kv_cache_memory: float | None = _arg(
        None, "KV pool budget: bytes, or a fraction (<= 1) of available RAM", type=float
    )
    enable_prefix_caching: bool = _arg(
        True, "reuse the KV of earlier requests' shared prompt prefixes", type=bool
    )
    threads: int | None = _arg(
        None, "CPU threads for torch and the native kernels (llama.cpp's -t)", type=int,
        flags=("-t",),
    )  # fmt: skip
    # -- vLLM's older speculative keyword arguments / flags, and llama.cpp's
    speculative_model: str | None = _arg(
        None, "vLLM < 0.7: draft model, or [ngram]", kind=SPECULATIVE
    )
    num_speculative_tokens: int | None = _arg(
        None, "vLLM < 0.7: drafts per step", type=int, kind=SPECULATIVE
    )
    speculative_draft_tensor_parallel_size: int | None = _arg(
        None, "vLLM < 0.7: 1 only", type=int, kind=SPECULATIVE
    )
    ngram_prompt_lookup_max: int | None = _arg(
        None, "vLLM < 0.7: prompt_lookup_max", type=int, kind=SPECULATIVE
    )
    ngram_prompt_lookup_min: int | None = _arg(
        None, "vLLM < 0.7: prompt_lookup_min", type=int, kind=SPECULATIVE
    )
    speculative_disable_by_batch_size: int | None = _arg(
        None, "vLLM < 0.7: disable_by_batch_size", type=int, kind=SPECULATIVE
    )
    spec_method: str | None = _arg(None, "vLLM: speculative_config.method", kind=SPECULATIVE)
    spec_model: str | None = _arg(None, "vLLM: speculative_config.model", kind=SPECULATIVE)
    spec_tokens: int | None = _arg(
        None, "vLLM: speculative_config.num_speculative_tokens", type=int, kind=SPECULATIVE
    )
    model_draft: str | None = _arg(
        None,
        "llama.cpp: draft model (method draft_model): a file, folder or hub id (-hfd org/name)",
        flags=("-md", "-hfd", "-hfrd", "--hf-repo-draft"),
        kind=SPECULATIVE,
    )
    draft_max: int | None = _arg(
        None,
        "llama.cpp: drafts per step (num_speculative_tokens)",
        type=int,
        flags=("--draft", "--draft-n"),
        kind=SPECULATIVE,
    )
    draft_min: int | None = _arg(
        None,
        "llama.cpp: fewer drafts than this are not verified (each request's default "
        "speculative_n_min)",
        type=int,
        flags=("--draft-n-min",),
        kind=SPECULATIVE,
    )
    draft_p_min: float | None = _arg(
        None,
        "llama.cpp: drafts whose draft probability is below this are cut (drafters that report "
        "one; each request's default speculative_p_min)",
        type=float,
        kind=SPECULATIVE,
    )
    # -- one device
    tensor_parallel_size: int = _arg(
        1, "ranks running the target, each with its shard of the weights and KV heads",
        type=int, flags=("-tp",),
    )  # fmt: skip
    distributed_executor_backend: str | None = _arg(
        None, "how the ranks run: uni (one process) or mp (worker processes; the default above "
        "tensor_parallel_size 1)",
    )  # fmt: skip
    cpu_binding: str | None = _arg(
        None, "each rank's cores, '|'-separated ('0-31|32-63'; env SPECDEC_CPU_OMP_THREADS_BIND); "
        "default: the usable cores split evenly",
    )  # fmt: skip
    pipeline_parallel_size: int = _arg(1, "1 only", type=int, flags=("-pp",), kind=SINGLE)
    data_parallel_size: int = _arg(
        1,
        "specdec serve: engine replicas behind one endpoint; 1 elsewhere",
        type=int,
        flags=("-dp",),
        kind=SINGLE,
    )
    data_parallel_rank: int = _arg(
        0,
        "this engine's replica index: labels its KV events and offsets their ports (serve "
        "--data-parallel-size sets it for each replica)",
        type=int,
        flags=("-dpn",),
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
    # -- vLLM options that would change the output and cannot be honoured: their defaults (and
    # harmless values) are accepted, any other value is a one-line error naming the option
    task: str | None = _arg(
        None, "vLLM: generate (or auto) only", kind=REFUSED,
        check=_only(None, "auto", "generate", why=_TEXT_ONLY),
    )  # fmt: skip
    runner: str | None = _arg(
        None, "vLLM: generate (or auto) only", kind=REFUSED,
        check=_only(None, "auto", "generate", why=_TEXT_ONLY),
    )  # fmt: skip
    convert: str | None = _arg(
        None, "vLLM: none (or auto) only", kind=REFUSED,
        check=_only(None, "auto", "none", why=_TEXT_ONLY),
    )  # fmt: skip
    hf_overrides: Any = _arg(
        None, "vLLM: none (JSON)", type=json_value, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    hf_config_path: str | None = _arg(None, "vLLM: none", kind=REFUSED, check=_nothing(_ONE_MODEL))
    model_class_overrides: Any = _arg(
        None, "vLLM: none (JSON)", type=json_value, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    rope_scaling: Any = _arg(
        None, "older vLLM: none (JSON)", type=json_value, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    rope_theta: float | None = _arg(
        None, "older vLLM: none", type=float, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    quantization_config: Any = _arg(
        None, "vLLM: none (JSON); see --quantization", type=json_value, kind=REFUSED,
        check=_nothing("specdec quantizes with --quantization q8_0/q4_0/q4_1 only"),
    )  # fmt: skip
    logits_processors: list[str] | None = _arg(
        None, "vLLM: none", nargs="+", kind=REFUSED, check=_nothing(_NO_PLUGINS)
    )
    logprobs_mode: str | None = _arg(
        None, "vLLM: raw_logprobs only (what specdec returns)", kind=REFUSED,
        check=_only(None, "raw_logprobs", why="specdec returns raw_logprobs only"),
    )  # fmt: skip
    # -- hub ids: where their files come from (model/hub.py)
    revision: str | None = _arg(
        None, "vLLM: the branch, tag or commit of a hub id model (default main)", kind=HUB
    )
    download_dir: str | None = _arg(
        None,
        "vLLM: download hub models into this folder (the Hugging Face cache layout) instead "
        "of the Hugging Face cache (HF_HUB_CACHE)",
        kind=HUB,
    )
    hf_token: Any = _arg(
        None,
        "vLLM / llama.cpp: the token for gated and private hub repositories (default: HF_TOKEN, "
        "else the stored login; the flag alone: the stored login)",
        nargs="?",
        flags=("-hft",),
        kind=HUB,
    )
    hf_file: str | None = _arg(
        None,
        "llama.cpp: the file of the -hf repository to load, instead of the one the "
        "quantization picks",
        flags=("-hff",),
        kind=HUB,
    )
    # -- honoured by `specdec serve` (server sampling defaults; explicit --temp etc. win)
    generation_config: str | None = _arg(
        None,
        "vLLM: 'auto' reads the model folder's generation_config.json for default sampling "
        "(temperature, top_p, top_k, min_p, repetition_penalty); a folder reads that one's; "
        "'vllm' or none: neutral defaults",
        kind=SERVER,
    )
    override_generation_config: Any = _arg(
        None,
        "vLLM: JSON default sampling (temperature, top_p, top_k, min_p, repetition_penalty, "
        "presence_penalty, frequency_penalty) over generation_config's",
        type=json_value,
        kind=SERVER,
    )
    # -- vLLM / llama.cpp options without effect here (logged once when given)
    reasoning_parser: str | None = _ignored(
        None, "reasoning text stays in content (no reasoning_content field)",
        note="--reasoning-parser {value}: accepted, but reasoning is not split from the "
        "answer: its text stays in content (no reasoning_content field)",
    )  # fmt: skip
    reasoning_parser_plugin: str | None = _ignored(None, "no plugins")
    structured_outputs_config: Any = _ignored(
        None, "JSON; the built-in grammar engine is used", type=json_value,
        check=_only_harmless_structured,
    )  # fmt: skip
    guided_decoding_backend: str | None = _ignored(None, "older vLLM: the built-in grammar engine")
    additional_config: Any = _ignored(None, "JSON; platform options", type=json_value)
    enable_lora: bool = _ignored(False, "no adapters are loaded unless named", type=bool)
    scheduling_policy: str | None = _ignored(
        None, "fcfs; a request's priority changes when it runs, not its output"
    )
    trust_remote_code: bool = _ignored(
        False, "no remote code runs: architectures are built in", type=bool
    )
    enforce_eager: bool = _arg(
        False, "CUDA: run every step eagerly (no CUDA graphs; fixed shapes stay)", type=bool
    )
    static_shapes: bool | None = _arg(
        None,
        "fixed-shape forwards: every step at [slots x 8 rows], prompts in 128-row pieces, so a "
        "row's result never depends on its batch (speculation exact on GPUs) and a step is one "
        "CUDA graph; default: on for device cuda",
        type=bool,
    )
    async_scheduling: bool = _ignored(False, "one engine thread", type=bool)
    use_v2_block_manager: bool = _ignored(False, "slot-based KV pool", type=bool)
    enable_chunked_prefill: bool | None = _ignored(
        None, "prompts are always prefilled in chunks", type=bool
    )
    block_size: int | None = _ignored(None, "slot-based KV pool", type=int)
    swap_space: float | None = _ignored(None, "no GPU memory to swap", type=float)
    cpu_offload_gb: float | None = _ignored(None, "weights are in RAM", type=float)
    max_seq_len_to_capture: int | None = _ignored(None, "no CUDA graphs", type=int)
    disable_custom_all_reduce: bool = _ignored(False, "one device", type=bool)
    compilation_config: Any = _ignored(
        None, "no torch.compile (JSON or a level)", type=json_value, flags=("-cc",)
    )
    optimization_level: str | None = _ignored(None, "no torch.compile", flags=("-O",))
    performance_mode: str | None = _ignored(None, "GPU tuning")
    load_format: str | None = _ignored(None, "GGUF or safetensors, detected")
    code_revision: str | None = _ignored(None, "no remote code runs")
    tokenizer_revision: str | None = _ignored(None, "the tokenizer comes with the model")
    tokenizer_mode: str | None = _ignored(None, "the model's own tokenizer")
    config_format: str | None = _ignored(None, "config.json or GGUF metadata")
    max_logprobs: int | None = _ignored(None, "at most 20", type=int)
    n_gpu_layers: int | None = _ignored(
        None, "llama.cpp: no GPU offload; every layer runs on the CPU", type=int,
        flags=("-ngl", "--gpu-layers"),
    )  # fmt: skip
    # vLLM's GPU, multi-node, multimodal, LoRA and observability options: nothing to do on one
    # CPU device with text-only models (a parallel degree above 1 is refused above)
    enable_expert_parallel: bool = _ignored(
        False, "experts run on the one device", type=bool, flags=("-ep",)
    )
    max_parallel_loading_workers: int | None = _ignored(None, "one loader", type=int)
    kv_cache_memory_bytes: int | None = _arg(
        None, "vLLM: --kv-cache-memory in bytes", type=human_int, kind=ALIAS
    )
    allowed_local_media_path: str | None = _ignored(None, "text only")
    allowed_media_domains: list[str] | None = _ignored(None, "text only", nargs="+")
    allow_deprecated_quantization: bool = _ignored(False, "GPU", type=bool)
    enable_return_routed_experts: bool = _ignored(False, "GPU", type=bool)
    return_sampling_mask: bool = _ignored(False, "GPU", type=bool)
    use_fp64_gumbel: bool = _ignored(False, "counter-based draws", type=bool)
    enable_trace_replay: bool = _ignored(False, "GPU", type=bool)
    disable_sliding_window: bool = _ignored(False, "GPU attention", type=bool)
    disable_cascade_attn: bool = _ignored(False, "GPU attention", type=bool)
    skip_tokenizer_init: bool = _ignored(False, "the tokenizer is loaded", type=bool)
    enable_prompt_embeds: bool = _ignored(False, "token prompts only", type=bool)
    pooler_config: Any = _ignored(None, "no pooling models", type=json_value)
    override_pooler_config: Any = _ignored(None, "no pooling models", type=json_value)
    logits_processor_pattern: str | None = _ignored(None, "no plugins")
    enable_sleep_mode: bool = _ignored(False, "GPU", type=bool)
    enable_cumem_allocator: bool = _ignored(False, "GPU", type=bool)
    enable_nccl_comm_suspend: bool = _ignored(False, "GPU", type=bool)
    model_impl: str | None = _ignored(None, "built-in architectures")
    override_attention_dtype: str | None = _ignored(None, "GPU attention")
    io_processor_plugin: str | None = _ignored(None, "no plugins")
    renderer_num_workers: int | None = _ignored(None, "GPU", type=int)
    safetensors_load_strategy: str | None = _ignored(None, "loader")
    safetensors_prefetch_num_threads: int | None = _ignored(None, "loader", type=int)
    safetensors_prefetch_block_size: str | None = _ignored(None, "loader")
    model_loader_extra_config: Any = _ignored(None, "loader (JSON)", type=json_value)
    ignore_patterns: list[str] | None = _ignored(None, "loader", nargs="+")
    use_tqdm_on_load: bool = _ignored(True, "loader", type=bool)
    pt_load_map_location: str | None = _ignored(None, "loader")
    attention_backend: str | None = _ignored(None, "GPU attention")
    mamba_backend: str | None = _ignored(None, "no Mamba models")
    mamba_ssu_algorithm: str | None = _ignored(None, "no Mamba models")
    enable_mamba_cache_stochastic_rounding: bool = _ignored(False, "no Mamba models", type=bool)
    mamba_cache_philox_rounds: int | None = _ignored(None, "no Mamba models", type=int)
    master_addr: str | None = _ignored(None, "one host")
    master_port: int | None = _ignored(None, "one host", type=int)
    nnodes: int = _arg(1, "1 only", type=int, kind=SINGLE)
    node_rank: int | None = _ignored(None, "one host", type=int, flags=("-r",))
    distributed_timeout_seconds: int | None = _ignored(None, "one process", type=int)
    cpu_distributed_timeout_seconds: int | None = _ignored(None, "one process", type=int)
    numa_bind: bool = _ignored(False, "see --threads", type=bool)
    numa_bind_nodes: list[str] | None = _ignored(None, "see --threads", nargs="+")
    numa_bind_cpus: list[str] | None = _ignored(None, "see --threads", nargs="+")
    device_ids: str | None = _ignored(None, "one device")
    decode_context_parallel_size: int = _arg(1, "1 only", type=int, flags=("-dcp",), kind=SINGLE)
    prefill_context_parallel_size: int = _arg(1, "1 only", type=int, flags=("-pcp",), kind=SINGLE)
    dcp_comm_backend: str | None = _ignored(None, "one device")
    dcp_q_replicate: bool | None = _ignored(None, "one device", type=bool)
    dcp_kv_cache_interleave_size: int | None = _ignored(None, "one device", type=int)
    cp_kv_cache_interleave_size: int | None = _ignored(None, "one device", type=int)
    data_parallel_start_rank: int | None = _ignored(None, "one engine", type=int, flags=("-dpr",))
    data_parallel_size_local: int | None = _ignored(None, "one engine", type=int, flags=("-dpl",))
    data_parallel_address: str | None = _ignored(None, "one engine", flags=("-dpa",))
    data_parallel_rpc_port: int | None = _ignored(None, "one engine", type=int, flags=("-dpp",))
    data_parallel_backend: str | None = _ignored(None, "one engine", flags=("-dpb",))
    data_parallel_hybrid_lb: bool = _ignored(False, "one engine", type=bool, flags=("-dph",))
    data_parallel_external_lb: bool = _ignored(False, "one engine", type=bool, flags=("-dpe",))
    data_parallel_multi_port_external_lb: bool = _ignored(
        False, "one engine", type=bool, flags=("-dpm",)
    )
    enable_batch_sharded_sampling: bool | None = _ignored(None, "one device", type=bool)
    enable_ep_weight_filter: bool = _ignored(False, "one device", type=bool)
    all2all_backend: str | None = _ignored(None, "one device")
    enable_dbo: bool = _ignored(False, "one device", type=bool)
    ubatch_size: int | None = _ignored(None, "one device", type=int)
    enable_elastic_ep: bool = _ignored(False, "one device", type=bool)
    dbo_decode_token_threshold: int | None = _ignored(None, "one device", type=int)
    dp_sync_interval: int | None = _ignored(None, "one engine", type=int)
    dbo_prefill_token_threshold: int | None = _ignored(None, "one device", type=int)
    disable_nccl_for_dp_synchronization: bool | None = _ignored(None, "one engine", type=bool)
    enable_eplb: bool = _ignored(False, "one device", type=bool)
    eplb_config: Any = _ignored(None, "one device (JSON)", type=json_value)
    expert_placement_strategy: str | None = _ignored(None, "one device")
    num_redundant_experts: int | None = _ignored(None, "one device", type=int)
    eplb_window_size: int | None = _ignored(None, "one device", type=int)
    eplb_step_interval: int | None = _ignored(None, "one device", type=int)
    eplb_log_balancedness: bool | None = _ignored(None, "one device", type=bool)
    ray_workers_use_nsight: bool = _ignored(False, "one process", type=bool)
    worker_cls: str | None = _ignored(None, "one process")
    worker_extension_cls: str | None = _ignored(None, "one process")
    enable_fault_tolerance: bool = _ignored(False, "one process", type=bool)
    fault_tolerance_config: Any = _ignored(None, "one process (JSON)", type=json_value)
    enable_multimodal_encoder_data_parallel: bool = _ignored(False, "text only", type=bool)
    num_gpu_blocks_override: int | None = _ignored(None, "see --kv-cache-memory", type=int)
    prefix_caching_hash_algo: str | None = _ignored(None, "the pool's own hashing")
    prefix_cache_retention_interval: int | None = _ignored(None, "LRU", type=int)
    kv_cache_dtype_skip_layers: list[str] | None = _ignored(None, "GPU", nargs="+")
    kv_sharing_fast_prefill: bool = _ignored(False, "GPU", type=bool)
    calculate_kv_scales: bool = _ignored(False, "no fp8 KV", type=bool)
    mamba_cache_dtype: str | None = _ignored(None, "no Mamba models")
    mamba_ssm_cache_dtype: str | None = _ignored(None, "no Mamba models")
    mamba_block_size: int | None = _ignored(None, "no Mamba models", type=int)
    mamba_cache_mode: str | None = _ignored(None, "no Mamba models")
    kv_offloading_size: float | None = _ignored(None, "the KV pool is in RAM", type=float)
    kv_offloading_backend: str | None = _ignored(None, "the KV pool is in RAM")
    offload_backend: str | None = _ignored(None, "weights are in RAM")
    cpu_offload_params: list[str] | None = _ignored(None, "weights are in RAM", nargs="+")
    offload_group_size: int | None = _ignored(None, "weights are in RAM", type=int)
    offload_num_in_group: int | None = _ignored(None, "weights are in RAM", type=int)
    offload_prefetch_step: int | None = _ignored(None, "weights are in RAM", type=int)
    offload_params: list[str] | None = _ignored(None, "weights are in RAM", nargs="+")
    language_model_only: bool = _ignored(False, "text only", type=bool)
    limit_mm_per_prompt: Any = _ignored(None, "text only (JSON)", type=json_value)
    enable_mm_embeds: bool = _ignored(False, "text only", type=bool)
    media_io_kwargs: Any = _ignored(None, "text only (JSON)", type=json_value)
    mm_processor_kwargs: Any = _ignored(None, "text only (JSON)", type=json_value)
    mm_processor_cache_gb: float | None = _ignored(None, "text only", type=float)
    mm_processor_cache_type: str | None = _ignored(None, "text only")
    mm_hasher_algorithm: str | None = _ignored(None, "text only")
    mm_shm_cache_max_object_size_mb: int | None = _ignored(None, "text only", type=int)
    mm_encoder_only: bool = _ignored(False, "text only", type=bool)
    mm_encoder_tp_mode: str | None = _ignored(None, "text only")
    mm_encoder_attn_backend: str | None = _ignored(None, "text only")
    mm_encoder_attn_dtype: str | None = _ignored(None, "text only")
    mm_encoder_fp8_scale_path: str | None = _ignored(None, "text only")
    mm_encoder_fp8_scale_save_path: str | None = _ignored(None, "text only")
    mm_encoder_fp8_scale_save_margin: float | None = _ignored(None, "text only", type=float)
    interleave_mm_strings: bool = _ignored(False, "text only", type=bool)
    skip_mm_profiling: bool = _ignored(False, "text only", type=bool)
    video_pruning_rate: float | None = _ignored(None, "text only", type=float)
    video_pruning_method: str | None = _ignored(None, "text only")
    mm_tensor_ipc: str | None = _ignored(None, "text only")
    mm_processor_device: str | None = _ignored(None, "text only")
    mm_ipc_gpu_memory_gb: float | None = _ignored(None, "text only", type=float)
    mm_device_do_normalize: bool | None = _ignored(None, "text only", type=bool)
    disable_mm_preprocessor_cache: bool = _ignored(False, "text only", type=bool)
    max_loras: int | None = _ignored(None, _NO_LORA, type=int)
    max_lora_rank: int | None = _ignored(None, _NO_LORA, type=int)
    lora_dtype: str | None = _ignored(None, _NO_LORA)
    lora_extra_vocab_size: int | None = _ignored(None, _NO_LORA, type=int)
    enable_tower_connector_lora: bool = _ignored(False, _NO_LORA, type=bool)
    max_cpu_loras: int | None = _ignored(None, _NO_LORA, type=int)
    fully_sharded_loras: bool = _ignored(False, _NO_LORA, type=bool)
    lora_target_modules: list[str] | None = _ignored(None, _NO_LORA, nargs="+")
    default_mm_loras: Any = _ignored(None, _NO_LORA, type=json_value)
    specialize_active_lora: bool = _ignored(False, _NO_LORA, type=bool)
    enable_mixed_moe_lora_format: bool = _ignored(False, _NO_LORA, type=bool)
    enable_moe_shared_loras: bool = _ignored(False, _NO_LORA, type=bool)
    show_hidden_metrics_for_version: str | None = _ignored(None, "see /metrics")
    otlp_traces_endpoint: str | None = _ignored(None, "no tracing")
    collect_detailed_traces: list[str] | None = _ignored(None, "no tracing", nargs="+")
    per_request_spec_decode_metrics: str | None = _arg(
        None,
        "serve: each response's speculative figures in vLLM's shape, its top-level "
        "metrics.speculative_decoding ('summary'; 'detailed' gives the summary: per-step lists "
        "are not kept; 'none': off)",
        choices=("none", "summary", "detailed"),
        kind=SERVER,
    )
    kv_cache_metrics: bool = _ignored(False, "see /metrics", type=bool)
    kv_cache_metrics_sample: float | None = _ignored(None, "see /metrics", type=float)
    cudagraph_metrics: bool = _ignored(False, "no CUDA graphs", type=bool)
    enable_layerwise_nvtx_tracing: bool = _ignored(False, "no tracing", type=bool)
    enable_mfu_metrics: bool = _ignored(False, "see /metrics", type=bool)
    enable_logging_iteration_details: bool = _ignored(False, "see /metrics", type=bool)
    jit_monitor_mode: str | None = _ignored(None, "no JIT")
    jit_monitor_verbose: bool = _ignored(False, "no JIT", type=bool)
    aggregate_engine_logging: bool = _ignored(False, "one engine", type=bool)
    max_num_scheduled_tokens: int | None = _ignored(None, "see --max-num-batched-tokens", type=int)
    max_num_partial_prefills: int | None = _ignored(None, "chunked prefill", type=int)
    max_long_partial_prefills: int | None = _ignored(None, "chunked prefill", type=int)
    long_prefill_token_threshold: int | None = _ignored(None, "chunked prefill", type=int)
    num_lookahead_slots: int | None = _ignored(None, "drafts reserve their own KV", type=int)
    num_scheduler_steps: int | None = _ignored(
        None, "older vLLM: one scheduled step at a time (drafts give several tokens a step)",
        type=int,
    )  # fmt: skip
    disable_chunked_mm_input: bool = _ignored(False, "text only", type=bool)
    scheduler_cls: str | None = _ignored(None, "the built-in scheduler")
    disable_hybrid_kv_cache_manager: bool | None = _ignored(None, "one KV pool", type=bool)
    stream_interval: int | None = _ignored(None, "every step streams", type=int)
    cudagraph_capture_sizes: list[str] | None = _ignored(None, "no CUDA graphs", nargs="+")
    cuda_graph_sizes: list[str] | None = _ignored(None, "no CUDA graphs", nargs="+")
    max_cudagraph_capture_size: int | None = _ignored(None, "no CUDA graphs", type=int)
    ir_op_priority: Any = _ignored(None, "no torch.compile (JSON)", type=json_value)
    enable_flashinfer_autotune: bool | None = _ignored(None, "GPU", type=bool)
    enable_bf16x3_router_gemm: bool | None = _ignored(None, "GPU", type=bool)
    moe_backend: str | None = _ignored(None, "the native kernels")
    linear_backend: str | None = _ignored(None, "the native kernels")
    diffusion_config: Any = _ignored(None, "JSON", type=json_value, flags=("-dc",))
    kv_transfer_config: Any = _ignored(None, "one engine (JSON)", type=json_value)
    ec_transfer_config: Any = _ignored(None, "one engine (JSON)", type=json_value)
    ec_manager_config: Any = _ignored(None, "text only (JSON)", type=json_value)
    attention_config: Any = _ignored(None, "GPU attention (JSON)", type=json_value, flags=("-ac",))
    reasoning_config: Any = _ignored(None, "JSON", type=json_value)
    kernel_config: Any = _ignored(None, "the native kernels (JSON)", type=json_value)
    profiler_config: Any = _ignored(None, "no profiler (JSON)", type=json_value)
    weight_transfer_config: Any = _ignored(None, "one engine (JSON)", type=json_value)
    fail_on_environ_validation: bool = _ignored(False, "no vLLM environment", type=bool)
    gdn_prefill_backend: str | None = _ignored(None, "GPU")
    kda_prefill_backend: str | None = _ignored(None, "GPU")
    disable_log_stats: bool = _arg(
        False,
        "serve: no periodic throughput log line; LLM: no get_metrics()",
        type=bool,
        kind=SERVER,
    )

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, where: str = "LLM()", **kwargs: Any) -> EngineArgs:
        """Keyword arguments as ``LLM()`` takes them; an unknown one is a TypeError that names the
        closest known argument."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{where} got an unexpected keyword argument {key!r}{hint}")
        return cls(**kwargs)

    @classmethod
    def names(cls, *kinds: str) -> list[str]:
        """The arguments of these kinds (all when none is given), in declaration order."""
        return [f.name for f in fields(cls) if not kinds or f.metadata["kind"] in kinds]

    def replace(self, **changes: Any) -> EngineArgs:
        return EngineArgs.from_kwargs("EngineArgs.replace()", **{**self.__dict__, **changes})

    def create_engine_config(self) -> EngineConfig:
        """Check, resolve the speculative config and the aliases, log ignored options once."""
        given = [f for f in fields(self) if _given(getattr(self, f.name), f.default)]
        for f in given:
            value, meta = getattr(self, f.name), f.metadata
            if meta["kind"] == SINGLE and value != 1:
                raise ConfigError(
                    f"{f.name} ({_flag(f.name)}) must be 1 here, got {value!r}: {_SINGLE_WHY.get(f.name, 'not supported')}"
                )
            reason = meta["check"](value) if meta["check"] else None
            if reason:
                raise ConfigError(f"{f.name} ({_flag(f.name)}) {_short(value)}: {reason}")
        log_ignored([f.name for f in given if f.metadata["kind"] == IGNORED])
        for f in given:
            if f.metadata["note"]:
                log_note(f.name, f.metadata["note"].format(value=getattr(self, f.name)))
        engine = {n: getattr(self, n) for n in self.names(ENGINE)}
        if engine["kv_cache_memory"] is None:
            engine["kv_cache_memory"] = self.kv_cache_memory_bytes or self.gpu_memory_utilization
        speculative = self.speculative()
        # NOTE: hub ids become local paths here, once: the executor, its workers and the
        # drafters read files only, and --revision / --download-dir / --hf-token apply
        engine["model"] = self._local_model()
        if speculative is not None:
            speculative = self._local_drafter(speculative)
        self.generation_defaults()  # a bad generation config fails before the model loads
        return EngineConfig(**engine, speculative=speculative)

    def hub_options(self, revision: str | None = None, filename: str | None = None) -> HubOptions:
        """The HubOptions (model/hub.py) of these arguments: ``download_dir``, ``hf_token``."""
        from specdec.model.hub import HubOptions

        return HubOptions(revision, self.download_dir, self.hf_token, filename)

    def model_path(self) -> Path:
        """The model's local path: an alias's file, a path, or a hub id's files in
        the cache (downloaded on first use, with ``revision`` and ``hf_file``)."""
        from specdec.model.registry import resolve_model_path

        return resolve_model_path(self.model, self.hub_options(self.revision, self.hf_file))

    def _local_model(self) -> str:
        from specdec.model.hub import is_hub_id

        if not is_hub_id(self.model) or self.model in ALIASES:
            if self.hf_file:
                raise ConfigError(
                    f"hf_file (--hf-file) names a file of a hub repository; the model "
                    f"{self.model!r} is not a hub id (-hf org/name)"
                )
            return self.model
        return str(self.model_path())

    def _local_drafter(self, spec: SpeculativeConfig) -> SpeculativeConfig:
        """``speculative_config.model`` as a local path when it is a hub id: a draft model's
        files (draft_model, mtp) or a head's folder (eagle, eagle3, medusa, hybrid)."""
        from specdec.errors import ModelNotFoundError
        from specdec.model.hub import hub_model_path, is_hub_id

        if not spec.model or spec.model in ALIASES or not is_hub_id(spec.model):
            return spec
        kind = "model" if spec.method in ("draft_model", "mtp") else "head"
        try:
            path = hub_model_path(spec.model, self.hub_options(spec.revision), kind)
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"speculative_config.model: {e}") from None
        return replace(spec, model=str(path))

    def generation_defaults(self) -> dict[str, Any]:
        """Default sampling (SamplingParams names) from ``generation_config`` (vLLM's 'auto':
        the model folder's generation_config.json; a folder: its file) under
        ``override_generation_config``; ``specdec serve`` and ``LLM.generate`` apply them where
        a request does not set its own."""
        defaults = _generation_file_defaults(self.generation_config, self.model_path)
        override = self.override_generation_config
        if isinstance(override, str):
            override = _json_option("override_generation_config", override)
        if override in (None, {}):
            return defaults
        if not isinstance(override, dict):
            raise ConfigError("override_generation_config must be a JSON object")
        unknown = sorted(set(override) - set(OVERRIDE_GENERATION_KEYS))
        if unknown:
            raise ConfigError(
                f"override_generation_config: {', '.join(unknown)} cannot be applied; "
                f"allowed: {', '.join(OVERRIDE_GENERATION_KEYS)}"
            )
        return {**defaults, **override}

    def speculative(self) -> SpeculativeConfig | None:
        """The SpeculativeConfig from ``speculative_config``, or from vLLM's older keys
        (``speculative_model`` ...) or llama.cpp's (``-md``, ``--draft-max`` ...): one source
        names the method, the other keys refine it (a key given twice must agree)."""
        value = self._speculative_config_value()
        # NOTE: a speculative_config that names no method and no model only refines the method
        # another option names (`-md M --draft 5 --speculative-config '{"adaptive": false}'`)
        refines = isinstance(value, dict) and not {"method", "model"} & set(value)
        sources = [
            name
            for name in ("speculative_config", "speculative_model", "model_draft")
            if getattr(self, name) is not None and not (refines and name == "speculative_config")
        ]
        if len(sources) > 1:
            raise ConfigError(f"give one of {', '.join(sources)}, not several")
        overrides = {
            "num_speculative_tokens": self._agreeing("num_speculative_tokens", "draft_max"),
            "draft_tensor_parallel_size": self.speculative_draft_tensor_parallel_size,
            "prompt_lookup_max": self.ngram_prompt_lookup_max,
            "prompt_lookup_min": self.ngram_prompt_lookup_min,
            "disable_by_batch_size": self.speculative_disable_by_batch_size,
            "draft_min": self.draft_min,
            "draft_p_min": self.draft_p_min,
        }
        given = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(value, SpeculativeConfig):
            return replace(value, **given) if given else value
        if refines and sources:
            for key, v in value.items():
                if key in given and given[key] != v:
                    raise ConfigError(
                        f"speculative_config.{key} is {v!r} but another option sets {given[key]!r}"
                    )
            given, value = {**value, **given}, None
        if value is None and self.speculative_model is not None:
            value = {"model": self.speculative_model}
        if value is None and self.model_draft is not None:
            value = {"method": "draft_model", "model": self.model_draft}
        if value is None:
            if given:
                raise ConfigError(
                    f"{', '.join(_cli_names(given))} need a speculative method: "
                    "speculative_config, speculative_model or -md/--model-draft"
                )
            return None
        d = dict(value)
        for key, v in given.items():
            if key in d and d[key] != v:
                raise ConfigError(
                    f"speculative_config.{key} is {d[key]!r} but another option sets {v!r}"
                )
            d[key] = v
        return SpeculativeConfig.from_dict(d)

    def _speculative_config_value(self) -> SpeculativeConfig | dict | None:
        value = self.speculative_config
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
        if value is not None and not isinstance(value, (dict, SpeculativeConfig)):
            raise ConfigError("speculative_config must be a JSON object")
        flat = {"method": self.spec_method, "model": self.spec_model,
                "num_speculative_tokens": self.spec_tokens}  # fmt: skip
        flat = {k: v for k, v in flat.items() if v is not None}
        if not flat:
            return value
        # NOTE: vLLM's --spec-method / --spec-model / --spec-tokens are keys of
        # speculative_config; one key given both ways is an error, as in vLLM
        if isinstance(value, SpeculativeConfig):
            raise ConfigError("give --spec-* flags or a SpeculativeConfig, not both")
        d = dict(value or {})
        for key, v in flat.items():
            if key in d:
                raise ConfigError(
                    f"--spec-{key.split('_')[-1]} and speculative_config.{key} are both given; "
                    "give one"
                )
            d[key] = v
        return d

    def _agreeing(self, a: str, b: str) -> Any:
        va, vb = getattr(self, a), getattr(self, b)
        if va is not None and vb is not None and va != vb:
            raise ConfigError(f"{a} ({va}) and {b} ({vb}) disagree; give one")
        return va if va is not None else vb

    # ---- command line ------------------------------------------------------------------------
    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        names: list[str] | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        """Add a flag per argument (``names``: only those), grouped by kind; ``defaults``
        overrides some defaults (a benchmark's batch size, say)."""
        defaults = defaults or {}
        for f in fields(cls):
            if names is not None and f.name not in names:
                continue
            meta = f.metadata
            kind = meta["kind"]
            flags = [f"--{f.name.replace('_', '-')}", *meta["flags"]]
            default = defaults.get(f.name, f.default if f.default is not MISSING else None)
            text = meta["help"]
            if kind == IGNORED:
                text = f"no effect here: {text}"
            kw: dict[str, Any] = {"dest": f.name, "default": default, "help": text}
            if meta["type"] is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif meta["nargs"] == "?":  # vLLM's --hf-token [TOKEN]
                kw.update(nargs="?", const=True, type=meta["type"])
            elif meta["nargs"]:
                kw.update(nargs=meta["nargs"], type=meta["type"])
            elif meta["choices"]:
                kw["type"] = _cli_choice(f.name, meta["choices"], meta["aliases"])
                kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            else:
                kw["type"] = meta["type"]
            action = section_group(parser, help_section(f.name)).add_argument(*flags, **kw)
            if f.name in COMMON_ARGS:
                common(action, COMMON_ARGS[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments ``add_cli_args`` added (``serve``'s positional model wins over --model)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "model_tag", None):
            values["model"] = args.model_tag
        return cls(**values)


def _given(value: Any, default: Any) -> bool:
    """An option was given: neither None nor its default."""
    return value is not None and not (value is default or value == default)


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_option(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON ({e.msg} at column {e.colno})") from None


def _generation_file_defaults(value: str | None, model_path: Callable[[], Path]) -> dict[str, Any]:
    """vLLM's --generation-config: None / 'vllm': no defaults; 'auto': the model folder's
    generation_config.json if it has one (a GGUF file has none: logged); else a folder."""
    if value in (None, "vllm"):
        return {}
    from pathlib import Path

    if value == "auto":
        folder = model_path()
        path = folder / "generation_config.json" if folder.is_dir() else None
        if path is None or not path.is_file():
            log_note("generation_config", "generation_config auto: the model has no "
                     "generation_config.json; neutral sampling defaults")  # fmt: skip
            return {}
    else:
        path = Path(value).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ConfigError(f"generation_config: no generation_config.json in {value}")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"generation_config: cannot read {path}: {e}") from None
    return {ours: data[key] for key, ours in GENERATION_CONFIG_KEYS.items() if key in data}


def _cli_names(keys: dict[str, Any]) -> list[str]:
    return [k.replace("_", "-") for k in keys]


def _cli_choice(name: str, choices: tuple[str, ...], aliases: dict[str, str]):
    def parse(value: str) -> str:
        try:
            return _one_of(name, value, choices, aliases)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name
    return parse


_LOGGED_IGNORED: set[str] = set()


def log_ignored(names: list[str]) -> None:
    """One warning per process for the options that change nothing here."""
    new = [n for n in names if n not in _LOGGED_IGNORED]
    if new:
        _LOGGED_IGNORED.update(new)
        logger.warning("ignored on CPU: %s (they change nothing here)", ", ".join(new))


def log_note(name: str, message: str) -> None:
    """One warning per process for an option that is accepted with a caveat."""
    if f"note:{name}" not in _LOGGED_IGNORED:
        _LOGGED_IGNORED.add(f"note:{name}")
        logger.warning("%s", message)
