"""Engine configuration, validated on creation."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from specdec.model.registry import DEFAULT_MODEL

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# vLLM speculative_config keys about GPU execution (batch padding, kernels, block hashing,
# distributed drafting): accepted and logged once, they change nothing here.
VLLM_IGNORED_KEYS = (
    "disable_padded_drafter_batch", "disable_eagle_block_drop", "disable_lookahead_block_hashes",
    "enforce_eager", "attention_backend", "moe_backend", "index_share_for_mtp_iteration",
    "use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting",
    "draft_load_config", "revision", "code_revision", "max_model_len", "kv_cache_dtype",
    "draft_lm_head_quantization", "num_speculative_tokens_per_batch_size", "disable_log_stats",
    "disable_logprobs", "acceptance_method", "rejection_sample_method",
    "enable_adaptive_verification",
)  # fmt: skip
logger = logging.getLogger("specdec.config")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what is allowed."""


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys."""

    method: str = "ngram"
    # None: 32 for suffix (vLLM's default: it sizes its own drafts, this is only the cap), else 5
    num_speculative_tokens: int | None = None
    model: str | None = None
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
        from specdec.spec_decode import METHODS, canonical_method

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
        d = dict(d)
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


DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's and llama.cpp's other spellings
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "f32": "float32", "half": "float16",
                 "fp16": "float16", "f16": "float16", "bf16": "bfloat16"}  # fmt: skip
DEVICES = ("cpu", "cuda")
DEVICE_ALIASES = {"auto": "cpu"}
KERNELS = ("auto", "native", "torch")
QUANTIZATIONS = ("auto", "fp32", "q8_0", "q4_0", "q4_1")
QUANTIZATION_ALIASES = {"gguf": "auto", "none": "auto"}  # vLLM's name for a GGUF file's own
ACTIVATION_DTYPES = ("auto", "float32", "int8", "bf16x2")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# llama.cpp's (-ctk / -ctv) and vLLM's short spellings
KV_CACHE_DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "f16": "float16",
                          "fp16": "float16", "half": "float16", "bf16": "bfloat16"}  # fmt: skip


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
    seed: int = 0
    kv_cache_memory: float | None = None  # bytes (> 1) or a fraction of available RAM (<= 1)
    enable_prefix_caching: bool = True  # reuse the KV of earlier requests' shared prefixes
    # KV cache element type: "auto" (float16 on the native CPU kernels, else the model's dtype)
    # | "float32" | "float16" | "bfloat16"
    kv_cache_dtype: str = "auto"
    threads: int | None = None  # torch (and native kernel) threads; None: torch's choice
    speculative: SpeculativeConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = _one_of("dtype", self.dtype, DTYPES, DTYPE_ALIASES)
        self.device = _one_of("device", self.device, DEVICES, DEVICE_ALIASES)
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
        if self.max_model_len is not None:
            _check_engine_int("max_model_len", self.max_model_len, 16)
        if self.threads is not None:
            _check_engine_int("threads", self.threads, 1)
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
SERVER = "server"  # read by `specdec serve` only

_GROUP_TITLES = {
    ENGINE: "engine",
    SPECULATIVE: "speculative decoding (vLLM's older flags, llama.cpp's)",
    SINGLE: "parallelism (one device: 1 only)",
    ALIAS: "vLLM aliases",
    IGNORED: "accepted for vLLM / llama.cpp commands, no effect on CPU (logged once)",
    SERVER: "server",
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
) -> Any:
    """A field of EngineArgs: its default, help, CLI type and extra flag spellings."""
    meta = {"help": help, "type": type, "flags": flags, "choices": choices,
            "aliases": aliases or {}, "kind": kind}  # fmt: skip
    return field(default=default, metadata=meta)


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
        DEFAULT_MODEL, "model: an alias, a .gguf file or a Hugging Face folder", flags=("-m",)
    )
    speculative_config: Any = _arg(
        None,
        "speculative decoding, vLLM's keys as JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 5}\'',
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
    device: str = _arg("cpu", "cpu or cuda (auto: cpu)", choices=DEVICES, aliases=DEVICE_ALIASES)
    kernels: str = _arg(
        "auto", "native (C++, batch-invariant) or torch; auto: native when built", choices=KERNELS
    )
    quantization: str = _arg(
        "auto",
        "weight format: the file's own (auto, vLLM's gguf), or converted to fp32/q8_0/q4_0/q4_1",
        choices=QUANTIZATIONS,
        aliases=QUANTIZATION_ALIASES,
    )
    activation_dtype: str = _arg(
        "auto",
        "int8: llama.cpp-style 8-bit activations for quantized weights (fast on AVX-512 VNNI); "
        "bf16x2: activations as two bfloat16s on AMX-BF16 tiles for f16/bf16 weights (~2-3x "
        "faster prefill; f16 decode slower); float32: exact float activations (matches "
        "transformers); auto: int8 for quantized weights where fast, bf16x2 for bf16 weights "
        "on AMX-BF16 CPUs, else float32",
        choices=ACTIVATION_DTYPES,
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache element type: float16 (half the memory; llama.cpp's default f16), float32 "
        "(transformers' arithmetic), bfloat16 (torch kernels only); auto: float16 on the native "
        "CPU kernels, else the model's dtype",
        choices=KV_CACHE_DTYPES,
        aliases=KV_CACHE_DTYPE_ALIASES,
    )
    max_model_len: int | None = _arg(
        None,
        "context length (prompt + output); default min(4096, the model's)",
        type=int,
        flags=("-c", "--ctx-size"),
    )
    max_num_seqs: int = _arg(
        8, "sequences decoded together (llama.cpp's -np/--parallel)", type=int,
        flags=("-np", "--parallel"),
    )  # fmt: skip
    max_num_batched_tokens: int = _arg(
        512, "tokens per step; longer prompts are prefilled in chunks of this size", type=int
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
    model_draft: str | None = _arg(
        None, "llama.cpp: draft model (method draft_model)", flags=("-md",), kind=SPECULATIVE
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
    tensor_parallel_size: int = _arg(1, "1 only", type=int, flags=("-tp",), kind=SINGLE)
    pipeline_parallel_size: int = _arg(1, "1 only", type=int, flags=("-pp",), kind=SINGLE)
    data_parallel_size: int = _arg(1, "1 only", type=int, flags=("-dp",), kind=SINGLE)
    # -- vLLM's name for kv_cache_memory as a fraction
    gpu_memory_utilization: float | None = _arg(
        None, "vLLM: --kv-cache-memory as a fraction of available RAM", type=float, kind=ALIAS
    )
    # -- vLLM / llama.cpp options without effect here
    trust_remote_code: bool = _arg(
        False, "no remote code runs: architectures are built in", type=bool, kind=IGNORED
    )
    enforce_eager: bool = _arg(False, "no graphs on CPU", type=bool, kind=IGNORED)
    async_scheduling: bool = _arg(False, "one engine thread", type=bool, kind=IGNORED)
    distributed_executor_backend: str | None = _arg(None, "one process", kind=IGNORED)
    use_v2_block_manager: bool = _arg(False, "slot-based KV pool", type=bool, kind=IGNORED)
    enable_chunked_prefill: bool | None = _arg(
        None, "prompts are always prefilled in chunks", type=bool, kind=IGNORED
    )
    block_size: int | None = _arg(None, "slot-based KV pool", type=int, kind=IGNORED)
    swap_space: float | None = _arg(None, "no GPU memory to swap", type=float, kind=IGNORED)
    cpu_offload_gb: float | None = _arg(None, "weights are in RAM", type=float, kind=IGNORED)
    max_seq_len_to_capture: int | None = _arg(None, "no CUDA graphs", type=int, kind=IGNORED)
    disable_custom_all_reduce: bool = _arg(False, "one device", type=bool, kind=IGNORED)
    compilation_config: str | None = _arg(None, "no torch.compile", kind=IGNORED)
    load_format: str | None = _arg(None, "GGUF or safetensors, detected", kind=IGNORED)
    download_dir: str | None = _arg(None, "nothing is downloaded", kind=IGNORED)
    revision: str | None = _arg(None, "nothing is downloaded", kind=IGNORED)
    tokenizer_mode: str | None = _arg(None, "the model's own tokenizer", kind=IGNORED)
    max_logprobs: int | None = _arg(None, "at most 20", type=int, kind=IGNORED)
    n_gpu_layers: int | None = _arg(
        None, "llama.cpp: no GPU offload; every layer runs on the CPU", type=int,
        flags=("-ngl", "--gpu-layers"), kind=IGNORED,
    )  # fmt: skip
    disable_log_stats: bool = _arg(
        False, "serve: no periodic throughput log line", type=bool, kind=SERVER
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
        for f in fields(self):
            if f.metadata["kind"] == SINGLE:
                value = getattr(self, f.name)
                if value not in (None, 1):
                    raise ConfigError(
                        f"{f.name} (--{f.name.replace('_', '-')}) must be 1, got {value!r}: "
                        "specdec runs on one device (no tensor, pipeline or data parallelism)"
                    )
        ignored = [
            f.name
            for f in fields(self)
            if f.metadata["kind"] == IGNORED and getattr(self, f.name) not in (None, f.default)
        ]
        log_ignored(ignored)
        engine = {n: getattr(self, n) for n in self.names(ENGINE)}
        if engine["kv_cache_memory"] is None and self.gpu_memory_utilization is not None:
            engine["kv_cache_memory"] = self.gpu_memory_utilization
        return EngineConfig(**engine, speculative=self.speculative())

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
        return value

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
        groups: dict[str, Any] = {}
        defaults = defaults or {}
        for f in fields(cls):
            if names is not None and f.name not in names:
                continue
            meta = f.metadata
            kind = meta["kind"]
            if kind not in groups:
                groups[kind] = parser.add_argument_group(_GROUP_TITLES[kind])
            flags = [f"--{f.name.replace('_', '-')}", *meta["flags"]]
            default = defaults.get(f.name, f.default if f.default is not MISSING else None)
            kw: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"]}
            if meta["type"] is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif meta["choices"]:
                kw["type"] = _cli_choice(f.name, meta["choices"], meta["aliases"])
                kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            else:
                kw["type"] = meta["type"]
            groups[kind].add_argument(*flags, **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments ``add_cli_args`` added (``serve``'s positional model wins over --model)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "model_tag", None):
            values["model"] = args.model_tag
        return cls(**values)


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
