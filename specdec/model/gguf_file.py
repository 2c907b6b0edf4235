"""Thin helpers over the `gguf` package: metadata as plain Python values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


def read_gguf(path: str | Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(path))


def gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key/value field as a Python value (str, int, float, bool or list of them)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out
