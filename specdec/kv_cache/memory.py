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

Collapsing copies the chunk into a fresh huge page: ~5 ms a chunk on a 2-core VM, so a
2,000-token sequence of SmolLM2-135M (44 chunks) took 240 ms and a 4,096-token one of a
Qwen3-1.7B shape (448 chunks) seconds, in the step that crossed the threshold, stalling every
stream beside it; collapsed on a thread beside the forwards, it still took ~5 ms of a core from
whichever steps it ran beside. The chunks are therefore collapsed by one background thread per
process, one at a time (the system call releases the GIL), and only while the model is idle: no
forward for ``QUIET_S`` (``note_forward``, called by the KV pool before each). A busy engine thus
leaves its chunks advised only, for the system's own collapsing thread (khugepaged) at its pace.
``release`` and ``use_base_pages`` take their chunks out of the queue first (and wait for the one
in flight). ``settle_huge_pages`` waits until the queue is empty.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections import deque
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
        ranges = _merge(ranges)
        _COLLAPSER.cancel(self, ranges)
        released = 0
        for start, end in ranges:
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
        (merged) that ``written`` fills at least half of and that is not backed yet: advised now,
        and collapsed by the background thread (module docstring). A chunk commits at most twice
        what was written in it. Returns the bytes advised."""
        if self._map is None:
            return 0
        filled: dict[int, int] = {}
        for lo, hi in _merge(written):
            for c in range(lo // HUGE_PAGE_SIZE * HUGE_PAGE_SIZE, hi, HUGE_PAGE_SIZE):
                filled[c] = filled.get(c, 0) + min(hi, c + HUGE_PAGE_SIZE) - max(lo, c)
        chunks = []
        for lo, hi in self._huge_chunks(ranges):
            for c in range(lo, hi, HUGE_PAGE_SIZE):
                if c in self._backed or 2 * filled.get(c, 0) < HUGE_PAGE_SIZE:
                    continue
                self._backed.add(c)
                self._map.madvise(mmap.MADV_HUGEPAGE, self._pad + c, HUGE_PAGE_SIZE)
                chunks.append(c)
        _COLLAPSER.submit(self, chunks)
        return len(chunks) * HUGE_PAGE_SIZE

    def _collapse(self, chunk: int) -> bool:
        """Collapse one advised chunk into a huge page now (the collapser's thread; best effort:
        a chunk the system cannot collapse keeps its pages)."""
        libc = _libc()
        if self._map is None or libc is None:
            return False
        addr = ctypes.c_void_p(self.tensor.data_ptr() + chunk)
        # EAGAIN / ENOMEM (no huge page free now), EINVAL (Linux < 6.1): left as it is
        return libc.madvise(addr, ctypes.c_size_t(HUGE_PAGE_SIZE), _MADV_COLLAPSE) == 0

    def use_base_pages(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Undo ``use_huge_pages`` over the chunks inside ``ranges``: later faults there take base
        pages again."""
        if self._map is None:
            return
        ranges = _merge(ranges)
        _COLLAPSER.cancel(self, ranges)
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


class _Collapser:
    """The process's background thread that collapses advised chunks (module docstring)."""

    QUIET_S = 0.05  # collapse only after this long without a forward

    def __init__(self) -> None:
        self.last_forward = 0.0  # time.monotonic() of the latest forward (note_forward)
        self._reset()
        if hasattr(os, "register_at_fork"):
            # NOTE: a child forked while the thread held the lock would wait on it forever
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        """No thread and nothing queued (at start, and in a forked child, which starts its own)."""
        self._cv = threading.Condition()
        self._queue: deque[tuple[PagedBuffer, int]] = deque()
        self._busy: tuple[PagedBuffer, int] | None = None  # the chunk being collapsed
        self._pid: int | None = None  # the process whose thread runs

    def submit(self, buf: PagedBuffer, chunks: list[int]) -> None:
        if not chunks:
            return
        with self._cv:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="specdec-huge-pages", daemon=True).start()
            self._queue.extend((buf, c) for c in chunks)
            self._cv.notify_all()

    def cancel(self, buf: PagedBuffer, ranges: list[tuple[int, int]]) -> None:
        """Drop ``buf``'s queued chunks that meet the byte ``ranges``, and wait for one in flight."""

        def meets(c: int) -> bool:
            return any(lo < c + HUGE_PAGE_SIZE and c < hi for lo, hi in ranges)

        with self._cv:
            if any(b is buf for b, _ in self._queue):
                self._queue = deque((b, c) for b, c in self._queue if b is not buf or not meets(c))
            while self._busy is not None and self._busy[0] is buf and meets(self._busy[1]):
                self._cv.wait()

    def settle(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight; False if ``timeout`` seconds pass first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._busy is None, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                quiet = time.monotonic() - self.last_forward
                if quiet >= self.QUIET_S:
                    self._busy = self._queue.popleft()
            if self._busy is None:
                time.sleep(self.QUIET_S - quiet)
                continue
            try:
                self._busy[0]._collapse(self._busy[1])
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()


_COLLAPSER = _Collapser()


def note_forward() -> None:
    """A forward is about to run: the collapsing thread waits for the model to be idle."""
    _COLLAPSER.last_forward = time.monotonic()


def settle_huge_pages(timeout: float = 60.0) -> bool:
    """Wait until every chunk advised so far has been collapsed (or given up); False if
    ``timeout`` seconds pass first. For tests and benchmarks: the engine never waits for it."""
    return _COLLAPSER.settle(timeout)


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
