"""The small checks the config dataclasses and the flags share: whole numbers, choices, JSON
text, and a value shortened for a message."""

from __future__ import annotations

import json
from typing import Any

from specdec.errors import ConfigError


def check_int(key: str, value: Any, minimum: int) -> None:
    """``value`` is an integer (not a bool) >= ``minimum``; the error names ``key`` as given
    (``speculative_config.draft_min``, ``max_num_seqs``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")


def one_of(key: str, value: Any, allowed: tuple[str, ...], aliases: dict[str, str]) -> str:
    """``value`` (or its alias) checked against ``allowed``; the error names the key."""
    resolved = aliases.get(value, value) if isinstance(value, str) else value
    if resolved not in allowed:
        also = f" (or {', '.join(aliases)})" if aliases else ""
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}{also}, got {value!r}")
    return resolved


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters for a one-line message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def json_option(key: str, text: str) -> Any:
    """An option's JSON text, parsed; the error names ``key`` and where the text goes wrong."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key} is not valid JSON ({e.msg} at column {e.colno})") from None
