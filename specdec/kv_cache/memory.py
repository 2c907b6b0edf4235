"""Page-level memory for the KV pool: reserve address space, commit pages on first write, give
them back when a slot no longer needs them.

A CPU pool lives in an anonymous private mapping (``mmap``, ``MAP_NORESERVE``): reserving it costs
address space only, a page is committed when a sequence first writes it, and
``madvise(MADV_DONTNEED)`` returns a range's pages to the system (they read as zeros afterwards).
Other devices, and platforms without ``mmap.madvise``, get a plain ``torch.empty`` that never
gives pages back.

Huge pages (``PagedBuffer.use_huge_pages``): base pages cost one TLB entry per 4 KiB, and a
long sequence's attention reads its keys and values at a page walk every 4 KiB. The whole 2 MiB
chunks inside the ranges a long sequence owns that it fills at least half of are advised to
transparent huge pages and collapsed into them (``MADV_COLLAPSE``); ``use_base_pages`` undoes the
advice when the sequence is gone. The buffer starts on a 2 MiB boundary so that every whole
2 MiB of it can be one huge page.
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
HUGE_PAGE_SIZE = 2 << 20
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if os.name == "posix" else 0)
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux 6.1


def aligned_anonymous(
    nbytes: int, advice: int, flags: int = 0
) -> tuple[mmap.mmap, int, torch.Tensor]:
    """A private anonymous mapping one huge page longer than ``nbytes``, given ``advice``
    (``MADV_HUGEPAGE`` / ``MADV_NOHUGEPAGE``) before any page is touched: the mapping, the offset
    of the 2 MiB boundary in it, and the ``[nbytes]`` byte tensor that starts there (whose every
    whole 2 MiB can be one huge page). The tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    m.madvise(advice)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    pad = -whole.data_ptr() % HUGE_PAGE_SIZE
    return m, pad, whole[pad : pad + nbytes]


class PagedBuffer:
    """``nbytes`` of address space as a byte tensor whose pages can be given back.

    ``tensor`` is ``[nbytes]`` uint8 on ``device``; view it with the dtype and shape you need.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self._map: mmap.mmap | None = None
        self._backed: set[int] = set()  # offsets of the chunks use_huge_pages backed
        if device.type == "cpu" and nbytes > 0 and hasattr(mmap.mmap, "madvise"):
            # NOTE: transparent huge pages would commit 2 MiB for the first KV row a slot writes
            # in each (layer, head): keep commits at the base page size until use_huge_pages.
            self._map, self._pad, self.tensor = aligned_anonymous(
                nbytes, mmap.MADV_NOHUGEPAGE, _MAP_NORESERVE
            )
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
                self._map.madvise(mmap.MADV_DONTNEED, self._pad + lo, hi - lo)
                released += hi - lo
        return released

    def use_huge_pages(
        self, ranges: Iterable[tuple[int, int]], written: Iterable[tuple[int, int]]
    ) -> int:
        """Back with transparent huge pages each whole 2 MiB chunk inside the byte ``ranges``
        (merged) that ``written`` fills at least half of and that is not backed yet: advised, and
        collapsed now (best effort: a chunk the system cannot collapse keeps its pages). A chunk
        commits at most twice what was written in it. Returns the bytes collapsed."""
        if self._map is None:
            return 0
        filled: dict[int, int] = {}
        for lo, hi in _merge(written):
            for c in range(lo // HUGE_PAGE_SIZE * HUGE_PAGE_SIZE, hi, HUGE_PAGE_SIZE):
                filled[c] = filled.get(c, 0) + min(hi, c + HUGE_PAGE_SIZE) - max(lo, c)
        collapsed = 0
        for lo, hi in self._huge_chunks(ranges):
            for c in range(lo, hi, HUGE_PAGE_SIZE):
                if c in self._backed or 2 * filled.get(c, 0) < HUGE_PAGE_SIZE:
                    continue
                self._backed.add(c)
                self._map.madvise(mmap.MADV_HUGEPAGE, self._pad + c, HUGE_PAGE_SIZE)
                try:
                    self._map.madvise(_MADV_COLLAPSE, self._pad + c, HUGE_PAGE_SIZE)
                    collapsed += HUGE_PAGE_SIZE
                except OSError:  # EAGAIN / ENOMEM (no huge page free now), EINVAL (Linux < 6.1)
                    pass
        return collapsed

    def use_base_pages(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Undo ``use_huge_pages`` over the chunks inside ``ranges``: later faults there take base
        pages again."""
        if self._map is None:
            return
        for lo, hi in self._huge_chunks(ranges):
            chunks = set(range(lo, hi, HUGE_PAGE_SIZE))
            if chunks & self._backed:
                self._backed -= chunks
                self._map.madvise(mmap.MADV_NOHUGEPAGE, self._pad + lo, hi - lo)

    def resident_bytes(self) -> int:
        """Bytes of this buffer committed in RAM now (``mincore``); 0 where it cannot tell."""
        return resident_bytes(self.tensor) if self._map is not None else 0

    @staticmethod
    def _huge_chunks(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The whole 2 MiB chunks inside the merged ranges: nothing outside them is advised, so
        no other range's pages are committed by a huge page."""
        inner = [
            (-(-lo // HUGE_PAGE_SIZE) * HUGE_PAGE_SIZE, hi // HUGE_PAGE_SIZE * HUGE_PAGE_SIZE)
            for lo, hi in _merge(ranges)
        ]
        return [(lo, hi) for lo, hi in inner if hi > lo]


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
