"""Per-rank CPU binding for tensor parallelism: ``"0-31|32-63"`` (vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` syntax), from ``cpu_binding`` or ``SPECDEC_CPU_OMP_THREADS_BIND``;
by default the usable cores split evenly between the ranks."""

from __future__ import annotations

import os

import torch

from specdec.errors import ConfigError

BIND_ENV = "SPECDEC_CPU_OMP_THREADS_BIND"


def _parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(part)
        cores.extend(range(first, last + 1))
    return cores


def parse_cores(text: str) -> list[int]:
    """``"0-3,6"`` -> [0, 1, 2, 3, 6]; ValueError for a malformed list."""
    return _parse_cores(text)


def even_split(usable: list[int], num_groups: int) -> list[list[int]]:
    """``usable`` split evenly into ``num_groups`` (more groups than cores: they share, round
    robin; slow, correct)."""
    if num_groups > len(usable):
        return [[usable[g % len(usable)]] for g in range(num_groups)]
    per = len(usable) // num_groups
    return [usable[g * per : (g + 1) * per] for g in range(num_groups)]


def parse_cpu_binding(binding: str | None, num_ranks: int) -> list[list[int]]:
    """Each rank's cores. A binding naming cores this process cannot use, or a count of
    groups other than ``num_ranks``, is a one-line ``ConfigError`` naming ``cpu_binding``."""
    usable = sorted(os.sched_getaffinity(0))
    binding = binding if binding is not None else os.environ.get(BIND_ENV) or None
    if binding is None:
        return even_split(usable, num_ranks)
    try:
        groups = [_parse_cores(g) for g in binding.split("|")]
    except ValueError:
        raise ConfigError(
            f"cpu_binding {binding!r}: expected core lists like '0-3|4-7' (one per rank)"
        ) from None
    if len(groups) != num_ranks:
        raise ConfigError(
            f"cpu_binding {binding!r} names {len(groups)} core groups for "
            f"tensor_parallel_size {num_ranks}"
        )
    missing = sorted({c for g in groups for c in g} - set(usable))
    if missing:
        raise ConfigError(
            f"cpu_binding {binding!r} names cores this process cannot use: "
            f"{','.join(map(str, missing[:8]))} (usable: {len(usable)} cores)"
        )
    return groups


def bind_rank(cores: list[int], threads: int | None = None) -> None:
    """Pin this process to ``cores`` with one torch thread per core (before loading, so that
    its weights are first touched, and placed, by its own threads)."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads or len(cores))
