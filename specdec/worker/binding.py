"""Moved to ``specdec.distributed.binding``; re-exported here so that older imports keep
working."""

from specdec.distributed.binding import (
    BIND_ENV,
    bind_rank,
    even_split,
    parse_cores,
    parse_cpu_binding,
)

__all__ = ["BIND_ENV", "bind_rank", "even_split", "parse_cores", "parse_cpu_binding"]
