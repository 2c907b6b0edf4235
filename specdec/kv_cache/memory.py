"""Page-level memory for the KV pool: reserve address space, commit pages on first write, give
them back when a slot no longer needs them.

A CPU pool lives in an anonymous private mapping (``mmap``, ``MAP_NORESERVE``): reserving it costs
address space only, a page is committed when a sequence first writes it, and
``madvise(MADV_DONTNEED)`` returns a range's pages to the system (they read as zeros afterwards).
Other devices, and platforms without ``mmap.madvise``, get a plain ``torch.empty`` that never
gives pages back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable

import numpy as np
import torch

PAGE_SIZE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if os.name == "posix" else 0)


class PagedBuffer:
    """``nbytes`` of address space as a byte tensor whose pages can be given back.

    ``tensor`` is ``[nbytes]`` uint8 on ``device``; view it with the dtype and shape you need.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self._map: mmap.mmap | None = None
        if device.type == "cpu" and nbytes > 0 and hasattr(mmap.mmap, "madvise"):
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
            self._map = mmap.mmap(-1, nbytes, flags=flags)
            # NOTE: transparent huge pages would commit 2 MiB for the first KV row a slot writes
            # in each (layer, head): keep commits at the base page size.
            self._map.madvise(mmap.MADV_NOHUGEPAGE)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # [nbytes]
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]

    @property
    def can_release(self) -> bool:
        return self._map is not None

    def release(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Give back the whole pages inside each ``(start, end)`` byte range (adjacent ranges are
        merged first; partial pages at either end are kept). Returns the bytes covered."""
        if self._map is None:
            return 0
        released = 0
        for start, end in _merge(ranges):
            lo = -(-start // PAGE_SIZE) * PAGE_SIZE
            hi = end // PAGE_SIZE * PAGE_SIZE
            if hi > lo:
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                released += hi - lo
        return released

    def resident_bytes(self) -> int:
        """Bytes of this buffer committed in RAM now (``mincore``); 0 where it cannot tell."""
        return resident_bytes(self.tensor) if self._map is not None else 0


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        elif end > start:
            merged.append((start, end))
    return merged


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under ``t``'s storage that are resident (Linux ``mincore``)."""
    libc = _libc()
    if libc is None or t.device.type != "cpu":
        return 0
    start = t.untyped_storage().data_ptr()
    nbytes = t.untyped_storage().nbytes()
    lo = start // PAGE_SIZE * PAGE_SIZE
    num_pages = -(-(start + nbytes - lo) // PAGE_SIZE)
    if num_pages == 0:
        return 0
    vec = np.zeros(num_pages, dtype=np.uint8)  # [pages] bit 0: resident
    addr, length = ctypes.c_void_p(lo), ctypes.c_size_t(num_pages * PAGE_SIZE)
    if libc.mincore(addr, length, vec.ctypes.data_as(ctypes.c_void_p)) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((vec & 1).sum()) * PAGE_SIZE


_LIBC: ctypes.CDLL | None | bool = False


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is False:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name, use_errno=True) if name and os.name == "posix" else None
        if _LIBC is not None and not hasattr(_LIBC, "mincore"):
            _LIBC = None
    return _LIBC  # type: ignore[return-value]
