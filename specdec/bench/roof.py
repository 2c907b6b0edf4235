"""The memory roof of a decode step: the bytes a forward must read over the machine's read
bandwidth. Nothing makes a one-row step faster than that (shared by ``specdec bench replay`` and
``benchmarks/memory_roof.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def read_bandwidth(threads: int, gib: float = 2.0, repeats: int = 5) -> float:
    """GB/s of ``torch.sum`` over a ``gib`` GiB float32 tensor on ``threads`` threads (best run)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * (1 << 30)) // 4)
        x.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(previous)


def gguf_step_bytes(path: str | Path) -> int:
    """The bytes of a GGUF file's tensors that one decode step reads: all of them, except the
    token embedding when an output layer of its own exists (then one row of it is read)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())
