"""How engine arguments are declared: ``_arg`` (a dataclass field with its help, CLI type, flag
spellings and kind), the kinds, the ``--help`` sections, and the helpers the flags share."""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from dataclasses import Field, field
from typing import Any

from specdec.config.checks import one_of
from specdec.errors import ConfigError

logger = logging.getLogger("specdec.config")

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


def field_section(f: Field) -> str:
    """The --help section of a field declared with ``_arg``: by name, else by kind."""
    return _NAME_SECTION.get(f.name) or _KIND_SECTION[f.metadata["kind"]]


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


def _given(value: Any, default: Any) -> bool:
    """An option was given: neither None nor its default."""
    return value is not None and not (value is default or value == default)


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _cli_names(keys: dict[str, Any]) -> list[str]:
    return [k.replace("_", "-") for k in keys]


def _cli_choice(name: str, choices: tuple[str, ...], aliases: dict[str, str]):
    def parse(value: str) -> str:
        try:
            return one_of(name, value, choices, aliases)
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
