"""Splitting this process's cores between replicas (``"0-3|4-7"``: vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` syntax, one group per replica, as tensor-parallel ranks take it)."""

from __future__ import annotations

import os

from specdec.config import ConfigError
from specdec.distributed.binding import even_split, parse_cores


def split_cores(
    num_groups: int, binding: str | None = None, field: str = "cpu_binding"
) -> list[list[int]]:
    """Each group's cores: ``binding`` parsed, or the usable cores split evenly (more groups than
    cores: they share, round robin). A bad binding is a one-line ``ConfigError`` naming ``field``."""
    usable = sorted(os.sched_getaffinity(0))
    if binding is None:
        return even_split(usable, num_groups)
    try:
        groups = [parse_cores(g) for g in binding.split("|")]
    except ValueError:
        raise ConfigError(f"{field} {binding!r}: expected core lists like '0-3|4-7'") from None
    if len(groups) != num_groups:
        raise ConfigError(
            f"{field} {binding!r} names {len(groups)} core groups, expected {num_groups}"
        )
    missing = sorted({c for g in groups for c in g} - set(usable))
    if missing:
        raise ConfigError(f"{field} {binding!r} names cores this process cannot use: {missing[:8]}")
    return groups
