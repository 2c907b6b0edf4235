"""Kernel-ready weights kept on disk, so that a model file is repacked once, not at every load.

Loading a GGUF file rearranges its weights for the kernels (8-bit activation tiles, K-quant
tiles, fused q|k|v and gate|up) into fresh anonymous memory. On a virtual machine most of that
time is the host backing fresh pages (1.7B Q4_0: 52% of the load in ``clear_page``), which a
memory map of an already cached file never pays; llama.cpp maps its file and is done in 0.5 s.
So the first load writes the packed weights to one file under the cache directory and every
later load reads that file: the same bytes, so the outputs are identical. Weights of 2 MiB and
more are read into huge-page memory (``_C.weight_from_file``): mapped in place, the file's 4 KiB
pages made a 1.7B Q4_0 decode step 1.03-1.09x slower (TLB misses, most likely). The smaller ones
are read together into one huge-page buffer (a model of small layers, such as SmolLM2-135M, had
nearly all its weights in 4 KiB pages). An untied embedding (a few rows read a step), routed
experts (a few read a step; mapped pages can be given back under memory pressure) and weights too
few to fill a huge page are views of a copy-on-write map of the file.

The file is named after the model and a key over everything the packing depends on: the
model file's (or folder's weight files') path, size and modification time, the settings that
choose the formats (quantization, activations, kernels), and the native extension build itself
(its size and modification time: a rebuild with another tile layout never reads old tiles).

Where: ``$SPECDEC_WEIGHT_CACHE`` (a directory, or ``off``), else
``$XDG_CACHE_HOME/specdec/weights`` (``~/.cache/specdec/weights``). A write that cannot be
done (read-only or full disk) is logged and skipped; a damaged file is ignored and rewritten.

Layout: ``SPDCWTS1``, the header's length (8 bytes, little endian), a JSON header
``{"key", "tensors": {name: {qtype, n, k, parts, store, dtype, shape, offset, nbytes}}}``,
then, from the next 4 KiB boundary, each tensor's bytes at a 4 KiB-aligned ``offset`` from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.kernels import PackedWeight
from specdec.kv_cache.memory import HUGE_PAGE_SIZE, aligned_anonymous
from specdec.model.gguf_file import split_parts

logger = logging.getLogger("specdec.model")

MAGIC = b"SPDCWTS1"
# Cache files kept per model file name (the newest; a new file removes the oldest beyond this).
KEEP_PER_MODEL = 3
# Weights this big or bigger are read into huge-page memory instead of mapped (see the module).
READ_MIN_BYTES = 2 << 20
# The smaller weights go to one huge-page buffer when they come to this much (else stay mapped).
ARENA_MIN_BYTES = HUGE_PAGE_SIZE
# Routed experts stay mapped: a step reads a few of them, and mapped pages can be given back under
# memory pressure, so a mixture of experts larger than the memory still runs (as from llama.cpp's
# map of its file).
ROUTED_EXPERT = ".experts."
FORMAT_VERSION = 3  # 3: files of 2 (one day) held Q8_0 for K-quants "auto" now runs as int8
_ALIGN = 4096
# torch dtype name -> (numpy dtype of the stored bytes, torch dtype to view them as)
_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "uint8": (np.uint8, torch.uint8),
    "float32": (np.float32, torch.float32),
    "float16": (np.float16, torch.float16),
    "bfloat16": (np.uint16, torch.bfloat16),
}


def cache_root() -> Path | None:
    """The cache directory, or None when ``SPECDEC_WEIGHT_CACHE`` is ``off`` (or 0, none)."""
    env = os.environ.get("SPECDEC_WEIGHT_CACHE")
    if env is not None:
        if env.strip().lower() in ("", "0", "off", "none", "false", "no"):
            return None
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdec" / "weights"


def _source_files(source: Path) -> list[Path]:
    if source.is_dir():
        return sorted(p for p in source.iterdir() if p.suffix in (".safetensors", ".json"))
    return [p for p in split_parts(source) if p.is_file()]  # a split GGUF: every part


def cache_key(source: Path, settings: dict[str, Any]) -> str:
    """Hex digest over the source files' identity, the packing settings and the native build."""
    from specdec import kernels

    files = []
    for p in _source_files(source):
        st = p.stat()
        files.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    ext = getattr(kernels._C, "__file__", None)
    build = None
    if ext:
        st = os.stat(ext)
        build = [st.st_size, st.st_mtime_ns]
    blob = json.dumps(
        {"format": FORMAT_VERSION, "files": files, "settings": settings, "build": build},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class WeightCache:
    """The packed linear weights of one model under one set of settings (see the module)."""

    def __init__(self, root: Path, source: Path, settings: dict[str, Any]) -> None:
        self.key = cache_key(source, settings)
        self.path = root / f"{source.name}-{self.key}.weights"
        self._index: dict[str, dict[str, Any]] = {}
        self._mapped: np.memmap | None = None
        # the weights under READ_MIN_BYTES, read into one huge-page buffer: name -> its bytes
        self._arena: dict[str, torch.Tensor] = {}
        self._pending: dict[str, PackedWeight] = {}
        self.hits = 0
        if self.path.is_file():
            try:
                self._open()
            except (OSError, ValueError, KeyError) as e:
                logger.warning(
                    "weight cache %s unreadable (%s); it will be rewritten", self.path, e
                )
                self._index, self._mapped = {}, None

    @classmethod
    def for_model(cls, source: Path, settings: dict[str, Any]) -> WeightCache | None:
        root = cache_root()
        if root is None:
            return None
        try:
            return cls(root, Path(source), settings)
        except OSError as e:  # e.g. the model file vanished under us: load without a cache
            logger.warning("weight cache unavailable (%s)", e)
            return None

    def _open(self) -> None:
        with open(self.path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise ValueError("not a specdec weight cache")
            (length,) = struct.unpack("<Q", head[8:16])
            header = json.loads(f.read(length))
        if header.get("key") != self.key:
            raise ValueError("key mismatch")
        start, size = _data_start(length), self.path.stat().st_size
        for e in header["tensors"].values():
            e["offset"] += start
            if e["offset"] + e["nbytes"] > size:
                raise ValueError("truncated")
        # NOTE: copy-on-write: the kernels only read, and a stray write can never reach the file
        self._mapped = np.memmap(self.path, mode="c")
        self._index = header["tensors"]
        self._arena = self._read_arena()
        arena = [
            (e["offset"], e["offset"] + e["nbytes"]) for e in map(self._index.get, self._arena)
        ]
        _populate(self._mapped, self._lazy_ranges() + self._read_ranges() + arena)

    def _lazy_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges of the file not mapped up front: an untied embedding (an ``lm_head`` of its
        own) is read a few rows per step, so only the rows of tokens seen become resident.

        NOTE: mapping it whole put a Qwen3-30B-A3B-shaped Q4_K_M file's 0.16 GiB embedding in the
        RSS after load (1.14x the 8-layer file; the goal is 1.1x), as llama.cpp's mmap does not.
        """
        e = self._index.get("embed_tokens")
        if e is None or "lm_head" not in self._index:
            return []
        return [(e["offset"], e["offset"] + e["nbytes"])]

    def _read(self, name: str, e: dict[str, Any]) -> bool:
        """Whether weight ``name`` is read into huge-page memory (else it is mapped)."""
        from specdec.kernels import _C

        lazy = name == "embed_tokens" and "lm_head" in self._index
        return e["nbytes"] >= READ_MIN_BYTES and not lazy and _C is not None

    def _read_arena(self) -> dict[str, torch.Tensor]:
        """The weights under READ_MIN_BYTES (not an unread embedding, nor a routed expert), read
        into one huge-page buffer, each at a 4 KiB boundary: a view of each by name. Empty when
        they come to less than ARENA_MIN_BYTES (they stay mapped).

        NOTE: mapped, they sit in the file's 4 KiB pages, a TLB entry each (and, in a virtual
        machine, a nested page walk per miss): SmolLM2-135M, whose layers' weights are all under
        2 MiB, ran a step 1.02-1.04x faster from one buffer in huge pages (N = 1 and 8, 200 and
        2,000 cached, two engines in one process alternated; 2-core Xeon VM)."""
        from specdec.kernels import _C

        if _C is None or not hasattr(mmap.mmap, "madvise"):
            return {}
        lazy = {lo for lo, _ in self._lazy_ranges()}
        small = sorted(
            (e["offset"], name)
            for name, e in self._index.items()
            if not self._read(name, e)
            and e["offset"] not in lazy
            and e["nbytes"] > 0
            and ROUTED_EXPERT not in name
        )
        at: dict[str, int] = {}
        total = 0
        for _, name in small:
            at[name] = total
            total += -(-self._index[name]["nbytes"] // _ALIGN) * _ALIGN
        if total < ARENA_MIN_BYTES:
            return {}
        _, _, buf = aligned_anonymous(total, mmap.MADV_HUGEPAGE)
        view = memoryview(buf.numpy())
        with open(self.path, "rb", buffering=0) as f:
            for offset, name in small:
                n = self._index[name]["nbytes"]
                dst = view[at[name] : at[name] + n]
                got = 0
                while got < n:
                    k = os.preadv(f.fileno(), [dst[got:]], offset + got)
                    if k <= 0:
                        raise ValueError("truncated")
                    got += k
        return {name: buf[at[name] : at[name] + self._index[name]["nbytes"]] for _, name in small}

    def _read_ranges(self) -> list[tuple[int, int]]:
        return [
            (e["offset"], e["offset"] + e["nbytes"])
            for name, e in self._index.items()
            if self._read(name, e)
        ]

    def get(self, name: str) -> PackedWeight | None:
        """The cached weight ``name`` (in huge-page memory, or a view of the mapped file), or
        None."""
        e = self._index.get(name)
        if e is None or self._mapped is None:
            return None
        np_dtype, dtype = _DTYPES[e["dtype"]]
        if self._read(name, e):
            from specdec.kernels import _C

            raw = _C.weight_from_file(str(self.path), e["offset"], e["nbytes"])
            t = raw.view(dtype).reshape(e["shape"])
        elif name in self._arena:
            t = self._arena[name].view(dtype).reshape(e["shape"])
        else:
            raw = self._mapped[e["offset"] : e["offset"] + e["nbytes"]]
            t = torch.from_numpy(raw.view(np_dtype)).view(dtype).reshape(e["shape"])
        parts = tuple((fmt, int(rows)) for fmt, rows in e["parts"])
        if e["store"] == "a8":
            w = PackedWeight(e["qtype"], e["n"], e["k"], None, parts=parts, a8=t)
        elif e["store"] == "x2":
            w = PackedWeight(e["qtype"], e["n"], e["k"], None, x2=t)
        else:
            w = PackedWeight(e["qtype"], e["n"], e["k"], t, parts=parts)
            if e["store"] == "data+a8":
                w.a8 = t  # K-quant tiles serve both kernels
        self.hits += 1
        return w

    def put(self, name: str, weight: PackedWeight) -> None:
        """Remember a weight packed the slow way, for :meth:`save`."""
        self._pending[name] = weight

    def save(self) -> None:
        """Write the weights put since loading (all of them on a miss) to the cache file."""
        if not self._pending or self._index:
            return
        entries: dict[str, dict[str, Any]] = {}
        tensors: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for name, w in self._pending.items():
            if w.holds_blocks:
                t = w.data
                store = "data+a8" if w.a8 is not None and w.a8 is w.data else "data"
            elif w.x2_tiles is not None:
                t, store = w.x2_tiles, "x2"
            else:
                t, store = w.a8, "a8"
            if t.device.type != "cpu" or str(t.dtype).removeprefix("torch.") not in _DTYPES:
                return  # NOTE: only CPU weights in the stored dtypes are cached
            t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            entries[name] = {
                "qtype": w.qtype, "n": w.out_features, "k": w.in_features,
                "parts": [list(p) for p in w.parts], "store": store,
                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "offset": offset, "nbytes": nbytes,
            }  # fmt: skip
            tensors.append((offset, t))
            offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        header = json.dumps({"key": self.key, "tensors": entries}).encode()
        data_start = _data_start(len(header))
        total = data_start + offset
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.path.parent).free
            if free < total + (1 << 30):
                logger.warning(
                    "weight cache: %.2f GB needed, %.2f GB free in %s; not written",
                    total / 1e9, free / 1e9, self.path.parent,
                )  # fmt: skip
                return
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                    for off, t in tensors:
                        f.seek(data_start + off)
                        f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
                    f.truncate(total)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            logger.warning("weight cache %s not written (%s)", self.path, e)
            return
        logger.info(
            "weight cache: wrote %s (%.2f GB); later loads read it (SPECDEC_WEIGHT_CACHE=off: "
            "never)", self.path, total / 1e9,
        )  # fmt: skip
        self._evict_older()

    def _evict_older(self) -> None:
        """Keep the KEEP_PER_MODEL newest cache files of this model file's name (this one
        included) and delete the rest: every rebuild of specdec and every change of settings
        writes a new file, and stale ones would otherwise pile up (each is as big as the model).
        A process that still maps a deleted file keeps its pages."""
        prefix = self.path.name[: -len(self.key) - len(".weights")]
        older: list[tuple[float, Path]] = []
        for p in self.path.parent.glob("*.weights"):
            # NOTE: the same model file name with another key (same length)
            if p != self.path and p.name.startswith(prefix) and len(p.name) == len(self.path.name):
                try:
                    older.append((p.stat().st_mtime, p))
                except OSError:  # removed meanwhile (another process)
                    continue
        older.sort(reverse=True)
        for _, p in older[KEEP_PER_MODEL - 1 :]:
            try:
                p.unlink()
                logger.info("weight cache: removed %s (older than the %d kept)", p, KEEP_PER_MODEL)
            except OSError as e:
                logger.warning("weight cache: could not remove %s (%s)", p, e)


def _data_start(header_len: int) -> int:
    """Where the tensors start: after the magic, the length and the header, 4 KiB aligned
    (tensor offsets in the header count from there)."""
    return -(-(16 + header_len) // _ALIGN) * _ALIGN


def _populate(a: np.memmap, skip: list[tuple[int, int]] = ()) -> None:
    """Map every page of the cache file but the ``skip`` byte ranges, one call per stretch
    (MADV_POPULATE_READ)."""
    from specdec.model.loader import _MADV_POPULATE_READ, advise_pages

    start = 0
    for lo, hi in sorted(skip):
        if lo > start:
            advise_pages(a[start:lo], _MADV_POPULATE_READ)
        start = max(start, hi)
    if start < a.shape[0]:
        advise_pages(a[start:], _MADV_POPULATE_READ)
