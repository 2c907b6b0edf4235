"""Splitting this process's cores between replicas (``"0-3|4-7"``: vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` syntax, one group per replica, as tensor-parallel ranks take it)."""

from __future__ import annotations

import os

from specdec.config import ConfigError


def _parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(part)
        cores.extend(range(first, last + 1))
    return cores


def split_cores(
    num_groups: int, binding: str | None = None, field: str = "cpu_binding"
) -> list[list[int]]:
    """Each group's cores: ``binding`` parsed, or the usable cores split evenly (more groups than
    cores: they share, round robin). A bad binding is a one-line ``ConfigError`` naming ``field``."""
    usable = sorted(os.sched_getaffinity(0))
    if binding is None:
        if num_groups > len(usable):
            return [[usable[g % len(usable)]] for g in range(num_groups)]
        per = len(usable) // num_groups
        return [usable[g * per : (g + 1) * per] for g in range(num_groups)]
    try:
        groups = [_parse_cores(g) for g in binding.split("|")]
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
