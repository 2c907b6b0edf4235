"""Flags and option helpers the benchmark subcommands share. Engine options come from
``EngineArgs`` (specdec.config): each benchmark takes the subset named here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from specdec.bench.dataset import DEFAULT_DATASET, BenchItem, load_items
from specdec.config import EngineArgs

# The engine options each benchmark exposes (flags and results.json settings).
FORWARD_COST_ENGINE_ARGS = (
    "model", "kernels", "quantization", "activation_dtype", "kv_cache_dtype", "threads",
)  # fmt: skip
LATENCY_ENGINE_ARGS = (
    *FORWARD_COST_ENGINE_ARGS, "max_model_len", "enable_prefix_caching", "seed",
)  # fmt: skip
SERVE_ENGINE_ARGS = (
    *LATENCY_ENGINE_ARGS, "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
)  # fmt: skip


def add_command(sub: Any, name: str, help: str, epilog: str) -> argparse.ArgumentParser:
    """A benchmark's sub-command, its epilog (configurations, examples) shown as written."""
    return sub.add_parser(
        name, help=help, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


@dataclass
class BenchOptions:
    """The options the latency and serve benchmarks share (``shared_options`` reads them from
    the flags); each benchmark's options add their own after these."""

    engine: EngineArgs
    datasets: list[str]
    configs: list[str]
    categories: list[str] | None = None
    num_prompts: int | None = None
    max_tokens: int = 256

    def load_items(self) -> list[BenchItem]:
        """The prompts to run: ``num_prompts`` of each of ``categories`` in ``datasets``."""
        return load_items(self.datasets, self.categories, self.num_prompts)


def shared_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the latency and serve benchmarks share, from their flags: the engine, the
    prompt sets (``add_dataset_args``), the configurations and max_tokens."""
    return {
        "engine": EngineArgs.from_cli_args(args),
        "datasets": args.dataset or [str(DEFAULT_DATASET)],
        "configs": args.configs,
        "categories": args.categories,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
    }


def flag_values(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The flags ``names`` as they were parsed, for the options fields of the same names."""
    return {name: getattr(args, name) for name in names}


def engine_settings(engine: EngineArgs, names: tuple[str, ...]) -> dict[str, Any]:
    """The engine options a benchmark exposes, for its results' settings."""
    return {name: getattr(engine, name) for name in names}


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def int_csv(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in csv(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{text}'")
    return values


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """--dataset / --categories / --num-prompts, shared by the latency and serve benchmarks."""
    p.add_argument("--dataset", action="append", default=None, metavar="FILE.jsonl",
                   help="prompt set (lines {id, category, turns}); repeatable (default: the "
                        "package's own small set, specdec/bench/prompts/default.jsonl)")  # fmt: skip
    p.add_argument(
        "--categories", type=csv, default=None, help="comma-separated categories to keep"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each category")
