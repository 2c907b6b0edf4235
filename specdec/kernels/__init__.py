"""Kernel library: weight-only linear layers (f32 and GGUF block formats), RMS norm, attention.

Two implementations of one interface (:class:`KernelOps`):

* :class:`NativeOps` -- the C++ extension ``specdec.kernels._C`` (AVX-512 or AVX2/FMA/F16C kernels
  picked at runtime, portable C++ otherwise).  Every op is *batch-invariant*: row ``r`` of an ``M``-row call
  is bit-identical to the same row computed alone, whatever ``M`` and the thread count.  That is
  what lets speculative verification (several rows) and plain decoding (one row) agree exactly.
* :class:`TorchOps` -- plain PyTorch, works on any device (CUDA included).  Not batch-invariant;
  meant for GPUs, debugging and as a reference.

Use :func:`get_ops` to pick one.
"""

from __future__ import annotations

import math
import os
import types
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specdec.kv_cache.pool import blocked_keys

try:
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: BaseException | None = None
except Exception as exc:  # extension not built, or built against another torch
    _C = None
    _IMPORT_ERROR = exc

__all__ = [
    "A8_QTYPES",
    "HALF_QTYPES",
    "KQUANT_QTYPES",
    "QTYPES",
    "KernelOps",
    "NativeOps",
    "PackedWeight",
    "TorchOps",
    "amx16_available",
    "concat_weights",
    "cpu_features",
    "get_ops",
    "int8_activations_fast",
    "int8_activations_pay",
    "kquant_float_fast",
    "kquant_int8_fast",
    "kquant_native_preferred",
    "kquant_supported",
    "native_available",
    "native_isa",
    "pack_weight",
    "quantize_weight",
    "set_native_isa",
]

# Formats quantize_weight makes (and pack_weight takes as GGUF blocks of 32).
QTYPES = ("f32", "q8_0", "q4_0", "q4_1")
# GGUF K-quants (super-blocks of 256): pack_weight takes their GGUF blocks and keeps them, repacked
# into tiles of 16 rows of the same size; nothing here quantizes to them.
KQUANT_QTYPES = ("q4_k", "q5_k", "q6_k")
# 16-bit weights (GGUF F16/BF16, Hugging Face float16/bfloat16): kept 16-bit; the native kernels
# widen them exactly in registers, so they compute what a float32 copy would, bit for bit.
HALF_QTYPES = ("f16", "bf16")
HALF_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}

BLOCK_SIZE = 32  # elements per GGUF block for every quantized QTYPE
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
KQUANT_BLOCK = 256  # elements per K-quant super-block
KQUANT_GGUF_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # per super-block in GGUF
KQUANT_TILE_BYTES = {"q4_k": 2304, "q5_k": 2816, "q6_k": 3360}  # 16 rows x 256: 16 GGUF blocks
_QT_CODE = {
    "f32": 0,
    "q8_0": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q4_k": 4,
    "q5_k": 5,
    "q6_k": 6,
    "f16": 9,
    "bf16": 10,
}
_QT_KQUANT = 8  # _C.linear's qtype for K-quant tiles (kernels.h QT_KQUANT)
# _C.linear's qtypes for 16-bit weights with bf16x2 activations (kernels.h QT_F16_X2 / QT_BF16_X2)
_QT_X2_CODE = {"f16": 11, "bf16": 12}
# Weight formats the 8-bit activation kernels take (see PackedWeight.enable_a8).
A8_QTYPES = ("q8_0", "q4_0", "q4_1", *KQUANT_QTYPES)


def native_available() -> bool:
    """True when the C++ extension was built and imports."""
    return _C is not None


def native_module() -> types.ModuleType | None:
    """The compiled extension module ``specdec.kernels._C``, or None when it is not built."""
    return _C


def native_unavailable_reason() -> str | None:
    """Why the extension is missing (None when it is available)."""
    if _C is not None:
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    if not any(f.startswith("_C.") and f.endswith((".so", ".pyd")) for f in os.listdir(here)):
        return f"the C++ extension specdec.kernels._C is not built (no _C.*.so in {here})"
    return f"{type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"


def cpu_features() -> dict[str, bool]:
    """CPU features as detected at runtime: avx2, fma, f16c (and avx512f, informational)."""
    if _C is not None:
        return {k: bool(v) for k, v in _C.cpu_features().items()}
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {name: name in flags for name in ("avx2", "fma", "f16c", "avx512f")}


def int8_activations_fast() -> bool:
    """True when the 8-bit activation kernels for Q8_0 / Q4_0 / Q4_1 run natively here: AVX-512
    VNNI (or AMX-INT8) with the AVX-512 table selected, or AVX2 (vpmaddubsw) with a vector table.

    Elsewhere they still run (a scalar twin with bit-identical results) but far slower than the
    float kernels.
    """
    return _C is not None and _C.a8_kernels() != "portable"


def int8_activations_pay(qtype: str) -> bool:
    """Whether the 8-bit activation kernels beat the float ones on weights of ``qtype`` here:
    every format with AVX-512 VNNI; with AVX2 the 4-bit ones only (a Q8_0 code takes two
    vpmaddubsw, about what the float kernels spend: gemma3-270m's Q8_0 layers ran 8 rows 0.9x and
    256 rows 0.74x float32's speed, SmolLM2's Q4_1 ones 1.9x and 1.5x)."""
    if all(part in KQUANT_QTYPES for part in qtype.split("+")):  # "q4_k+q6_k": fused parts
        return kquant_int8_fast()
    if not int8_activations_fast():
        return False
    return _C.a8_kernels() != "avx2" or qtype in ("q4_0", "q4_1")


def kquant_int8_fast() -> bool:
    """True when the K-quant 8-bit activation kernels run natively: AVX-512 VNNI with the
    AVX-512 table selected, or AVX2 (vpmaddubsw, kernels_avx2_kq.cpp) with a vector table."""
    if _C is None:
        return False
    if hasattr(_C, "kq_kernels"):
        return _C.kq_kernels() != "portable"
    return bool(_C.a8_available()) and _C.isa() == "avx512"


def kquant_float_fast() -> bool:
    """True when K-quant weights with float activations run vector kernels (AVX-512 only; the
    AVX2 table's float entry is the scalar twin)."""
    return _C is not None and bool(_C.a8_available()) and _C.isa() == "avx512"


def amx_available() -> bool:
    """True when the 8-bit activation kernels can use AMX-INT8 tiles here.

    That takes a build with the AMX unit (a compiler that accepts ``-mamx-int8``), a CPU with
    AMX-TILE and AMX-INT8, and the kernel's permission for the tile state (Linux, asked once per
    process).  Results are bit-identical to the VNNI kernels either way.
    """
    return _C is not None and hasattr(_C, "amx_available") and bool(_C.amx_available())


def set_native_amx(enabled: bool) -> None:
    """Allow (default) or forbid AMX-INT8 for the 8-bit activation kernels, process-wide.

    ``SPECDEC_AMX=0`` in the environment forbids it from the start.  A no-op without AMX.
    """
    if _C is not None and hasattr(_C, "set_amx"):
        _C.set_amx(bool(enabled))


def amx16_available() -> bool:
    """True when 16-bit weights can run with bf16x2 activations (AMX-BF16: built, CPU, OS)."""
    return _C is not None and hasattr(_C, "amx16_available") and bool(_C.amx16_available())


def a8_kernels() -> str | None:
    """Which 8-bit activation kernels run now: 'amx-int8', 'avx512vnni' or 'portable'."""
    return _C.a8_kernels() if _C is not None and hasattr(_C, "a8_kernels") else None


def native_isa() -> str | None:
    """Which native kernels run: 'avx512', 'avx2' or 'portable' (None without the extension)."""
    return _C.isa() if _C is not None else None


def set_native_isa(isa: str) -> None:
    """Force the native kernels process-wide: 'auto', 'avx512', 'avx2' or 'portable'.

    The environment variable SPECDEC_KERNELS_ISA sets the initial choice the same way.
    """
    if _C is None:
        raise RuntimeError(f"native kernels unavailable ({native_unavailable_reason()})")
    _C.set_isa(isa)


# ---------------------------------------------------------------------------------------------
# Weights


def _row_bytes(qtype: str, in_features: int) -> int:
    if qtype == "f32":
        return in_features * 4
    if qtype in KQUANT_QTYPES:
        return in_features // KQUANT_BLOCK * KQUANT_GGUF_BYTES[qtype]
    return in_features // BLOCK_SIZE * BLOCK_BYTES[qtype]


def kquant_supported(qtype: str, out_features: int, in_features: int) -> bool:
    """Whether a GGUF K-quant weight of this shape can stay native (pack_weight takes it)."""
    return (
        _C is not None
        and qtype in KQUANT_QTYPES
        and out_features % 16 == 0
        and in_features % KQUANT_BLOCK == 0
    )


def kquant_native_preferred(
    qtype: str, out_features: int, in_features: int, int8_activations: bool = True
) -> bool:
    """Whether loading should keep a GGUF K-quant weight native: it can, and its kernels run
    natively here: AVX-512 VNNI (both activation types), or AVX2 when 8-bit activations will run
    it (``int8_activations``).  Elsewhere Q8_0 is faster: its float kernels decode in registers,
    while a K-quant tile needs the scalar twins there."""
    if not (kquant_supported(qtype, out_features, in_features) and kquant_int8_fast()):
        return False
    return int8_activations or kquant_float_fast()


class PackedWeight:
    """Weight of a linear layer, ``[out_features, in_features]``, in kernel-ready storage.

    ``data`` is float32 ``[N, K]`` for ``f32``, float16 / bfloat16 ``[N, K]`` for ``f16`` /
    ``bf16`` (never widened in memory) and, for the GGUF block formats, uint8
    ``[N, row_bytes]`` holding each row's GGUF blocks unchanged (32 elements per block; q8_0:
    f16 scale + 32 int8; q4_0: f16 scale + 16 bytes of nibbles, value (q - 8) * d; q4_1: f16 d,
    f16 m + nibbles, value q * d + m; low nibbles are elements 0-15 of a block, high 16-31).

    K-quants (q4_k, q5_k, q6_k) hold flat uint8 tiles of 16 rows x 256 inputs instead of their
    GGUF blocks (the same bytes rearranged, layouts in csrc/kquants.cpp); ``parts`` lists
    ``(format, rows)`` in row order, so a fused weight may mix them (its ``qtype`` then reads
    e.g. ``"q4_k+q6_k"``).  One copy serves the float and the 8-bit activation kernels.

    Each weight is stored once: with the 8-bit activation kernels on (:meth:`enable_a8`), a
    q8_0 / q4_0 / q4_1 weight keeps only its repacked tiles ``a8`` (a lossless rearrangement of
    the blocks), and ``data`` gives the blocks back from them on demand (a new tensor each time;
    :meth:`dequantize_rows` unpacks only the rows asked for).
    """

    def __init__(
        self,
        qtype: str,
        out_features: int,
        in_features: int,
        data: torch.Tensor | None,
        parts: tuple[tuple[str, int], ...] = (),
        a8: torch.Tensor | None = None,
        x2: torch.Tensor | None = None,
    ) -> None:
        if data is None and a8 is None and x2 is None:
            raise ValueError("a PackedWeight needs its data or its kernel tiles")
        self.qtype = qtype
        self.out_features = out_features
        self.in_features = in_features
        self.parts = parts
        self._data = data
        # The same weight repacked for the 8-bit activation kernels (enable_a8); NativeOps.linear
        # uses it when set.  For q8_0 / q4_0 / q4_1 it replaces the blocks (see data).
        self.a8 = a8
        # 16-bit weights only: the tiles of the bf16x2 kernels (enable_x2), which then replace
        # the [N, K] data (it comes back from them on demand).
        self.x2_tiles = x2
        # Float copies made by TorchOps for quantized weights, one per device (lazily).
        self._float_cache: dict[str, torch.Tensor] = {}

    @classmethod
    def from_a8_parts(
        cls, qtype: str, parts: list[torch.Tensor], rows: list[int], in_features: int
    ) -> PackedWeight:
        """A q8_0 / q4_0 / q4_1 weight with the 8-bit activation kernels on, repacked straight
        from the GGUF block rows of its fused parts (q|k|v, gate|up): no copy of the blocks."""
        tiles = _C.repack_a8_cat(list(parts), _QT_CODE[qtype], list(rows), in_features)
        return cls(qtype, sum(rows), in_features, None, a8=tiles)

    @property
    def data(self) -> torch.Tensor:
        if self._data is not None:
            return self._data
        if self.x2_tiles is not None:
            return _C.unpack_x2(
                self.x2_tiles, _QT_CODE[self.qtype], self.out_features, self.in_features
            )
        return _C.unpack_a8(self.a8, _QT_CODE[self.qtype], self.out_features, self.in_features)

    @property
    def holds_blocks(self) -> bool:
        """False when the repacked tiles are the only copy (the blocks come back on demand)."""
        return self._data is not None

    def __repr__(self) -> str:
        return (
            f"PackedWeight({self.qtype}, [{self.out_features}, {self.in_features}]"
            f"{', a8' if self.a8 is not None else ''}{', x2' if self.x2 else ''})"
        )

    @property
    def device(self) -> torch.device:
        return self._storage.device

    @property
    def _storage(self) -> torch.Tensor:
        """The tensor the kernels read: the data, else the 8-bit or the bf16x2 tiles."""
        if self._data is not None:
            return self._data
        return self.a8 if self.a8 is not None else self.x2_tiles

    @property
    def x2(self) -> bool:
        """Whether the bf16x2 kernels run this weight (enable_x2)."""
        return self.x2_tiles is not None

    @property
    def is_kquant(self) -> bool:
        return bool(self.parts)

    def a8_eligible(self) -> bool:
        """Whether :meth:`enable_a8` can repack this weight (format and shape)."""
        return (
            _C is not None
            and (self.qtype in A8_QTYPES or self.is_kquant)
            and self.out_features % 16 == 0
            and self.device.type == "cpu"
        )

    def enable_a8(self) -> None:
        """Use the 8-bit activation kernels: activations are then quantized to int8 per block of
        32 (q8_0/q4_0/q4_1, whose weights are repacked once, the tiles replacing the blocks) or
        of 256 (K-quants, llama.cpp's Q8_K; their tiles serve as they are) and dotted with
        integer instructions.  Results differ slightly from the float path but stay
        batch-invariant."""
        if not self.a8_eligible():
            raise ValueError(
                f"8-bit activations need a native {'/'.join(A8_QTYPES)} weight with "
                f"out_features % 16 == 0 on CPU, got {self.qtype} [{self.out_features}, "
                f"{self.in_features}]"
            )
        if self.a8 is None:
            if self.is_kquant:
                self.a8 = self._data
            else:
                self.a8 = _C.repack_a8(
                    self._data, _QT_CODE[self.qtype], self.out_features, self.in_features
                )
                self._data = None  # NOTE: stored once; the blocks come back from the tiles

    def x2_eligible(self) -> bool:
        """Whether :meth:`enable_x2` can run this weight (16-bit, CPU, AMX-BF16 here)."""
        return self.qtype in HALF_QTYPES and self.device.type == "cpu" and amx16_available()

    def enable_x2(self) -> None:
        """Use the bf16x2 kernels (kernels_amx16.cpp): each float32 activation is split into
        two bfloat16s (hi + lo, ~16 significant bits) and dotted with the 16-bit weight on
        AMX-BF16 tiles, summed in float32.  Results differ from the float path by about 2^-16
        of each product but stay batch-invariant; prefill runs ~2-3x faster.  The weight is
        repacked once into the kernels' tiles, which replace ``data`` (given back on demand)."""
        if not self.x2_eligible():
            raise ValueError(
                f"bf16x2 activations need a native f16/bf16 weight on a CPU with AMX-BF16, got "
                f"{self.qtype} [{self.out_features}, {self.in_features}]"
                f"{'' if amx16_available() else ' (this CPU or build has no AMX-BF16)'}"
            )
        if self.x2_tiles is None:
            self.x2_tiles = _C.repack_x2(self._data, self.out_features, self.in_features)
            self._data = None  # NOTE: stored once; the rows come back from the tiles

    def disable_x2(self) -> None:
        if self.x2_tiles is not None:
            self._data = self.data  # the rows back, for the float kernels
        self.x2_tiles = None

    def disable_a8(self) -> None:
        if self.a8 is not None and self._data is None:
            self._data = self.data  # the blocks back, for the float kernels
        self.a8 = None

    @property
    def qtype_code(self) -> int:
        if self.x2:
            return _QT_X2_CODE[self.qtype]
        return _QT_KQUANT if self.is_kquant else _QT_CODE[self.qtype]

    def part_codes(self) -> list[int]:
        """``parts`` as _C takes them: [format code, rows, ...] (empty unless K-quant)."""
        return [v for fmt, rows in self.parts for v in (_QT_CODE[fmt], rows)]

    @property
    def nbytes(self) -> int:
        """Bytes of kernel storage (what one pass over the weight reads)."""
        t = self._storage
        return t.numel() * t.element_size()

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 ``[N, K]`` on ``data``'s device.

        Quantized types: a new tensor equal to ``gguf.quants.dequantize`` bit for bit (``f16`` /
        ``bf16``: their exact float32 values).  ``f32``: ``data`` itself (not a copy).
        """
        if self.qtype == "f32":
            return self.data
        if self.is_kquant:
            return self._dequantize_kq(None)
        return _dequantize(self.qtype, self.data, self.out_features, self.in_features)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Float32 ``[len(rows), K]`` of the selected output rows (e.g. an embedding lookup)."""
        if self.is_kquant:
            return self._dequantize_kq(rows.reshape(-1).cpu()).to(self.device)
        idx = rows.reshape(-1).to(self.device)
        if self.x2_tiles is not None:  # only the tiles: unpack just these rows
            rows16 = _C.unpack_x2(
                self.x2_tiles, _QT_CODE[self.qtype], self.out_features, self.in_features, idx
            )
            return rows16.float()
        if self._data is None:  # only the tiles: unpack just these rows
            blocks = _C.unpack_a8(
                self.a8, _QT_CODE[self.qtype], self.out_features, self.in_features, idx
            )
        else:
            blocks = self._data[idx]
        if (
            _C is not None
            and self.qtype in ("q8_0", "q4_0", "q4_1")
            and blocks.device.type == "cpu"
        ):
            # the same bits as _dequantize, without its ~10 torch ops (~0.3 ms a decode step)
            return _C.dequantize_blocks(blocks.contiguous(), _QT_CODE[self.qtype], self.in_features)
        return _dequantize(self.qtype, blocks, idx.numel(), self.in_features)

    def _dequantize_kq(self, rows: torch.Tensor | None) -> torch.Tensor:
        data = self.data.cpu()
        return _C.dequantize_kq(
            data, self.part_codes(), self.out_features, self.in_features, rows
        ).to(self.device)

    def float_weight(self, device: torch.device | str) -> torch.Tensor:
        """Float32 ``[N, K]`` on ``device``, made once and cached (used by TorchOps)."""
        device = torch.device(device)
        if self.qtype == "f32" and self.device == device:
            return self.data
        key = str(device)
        cached = self._float_cache.get(key)
        if cached is None:
            if self.is_kquant:
                cached = self._dequantize_kq(None).to(device)
            else:
                cached = _dequantize(
                    self.qtype, self.data.to(device), self.out_features, self.in_features
                )
            self._float_cache[key] = cached
        return cached


def _dequantize(qtype: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    if qtype == "f32" or qtype in HALF_QTYPES:
        return data.reshape(n, k).to(torch.float32)
    nb = k // BLOCK_SIZE
    blocks = data.reshape(n, nb, BLOCK_BYTES[qtype])

    def f16(lo: int) -> torch.Tensor:
        return blocks[..., lo : lo + 2].contiguous().view(torch.float16).to(torch.float32)

    if qtype == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
        return (q * f16(0)).reshape(n, k)
    qs = blocks[..., 4:] if qtype == "q4_1" else blocks[..., 2:]
    nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # elements 0-15, then 16-31
    if qtype == "q4_0":
        q = (nibbles.to(torch.int8) - 8).to(torch.float32)
        return (f16(0) * q).reshape(n, k)
    q = nibbles.to(torch.float32)
    return (f16(0) * q + f16(2)).reshape(n, k)


def pack_weight(
    qtype: str, data: torch.Tensor, out_features: int, in_features: int
) -> PackedWeight:
    """Wrap a weight for the kernels.

    ``qtype == "f32"``: ``data`` is float32 ``[N, K]``.  ``f16`` / ``bf16``: ``data`` is a torch
    float16 / bfloat16 ``[N, K]`` tensor, used as it is, or a numpy array of the 16-bit values
    (float16, uint16 bit patterns, or the GGUF bytes as uint8), copied once into kernel storage
    (never widened; see :func:`half_storage`).  Quantized types: ``data`` holds the raw
    GGUF block bytes of each row, uint8 ``[N, row_bytes]`` (e.g.
    ``torch.from_numpy(reader_tensor.data)``); it stays quantized, no float copy is made.
    K-quants are repacked into their tiles (the GGUF bytes are not kept); they need the native
    extension, ``N % 16 == 0`` and ``K % 256 == 0`` (see :func:`kquant_supported`).
    """
    known = QTYPES + KQUANT_QTYPES + HALF_QTYPES
    if qtype not in known:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {known}")
    n, k = int(out_features), int(in_features)
    if qtype in HALF_QTYPES:
        if isinstance(data, np.ndarray):
            allowed = (np.float16, np.uint16, np.uint8) if qtype == "f16" else (np.uint16, np.uint8)
            if data.dtype not in allowed:
                raise ValueError(
                    f"{qtype} weight from numpy must be one of {allowed}, got {data.dtype}"
                )
            data = half_storage(qtype, [data])
        if data.dtype != HALF_DTYPES[qtype] or data.numel() != n * k:
            raise ValueError(
                f"{qtype} weight must be {HALF_DTYPES[qtype]} with {n}x{k} elements, got "
                f"{data.dtype} with {data.numel()}"
            )
        return PackedWeight(qtype, n, k, data.reshape(n, k).contiguous())
    if isinstance(data, np.ndarray):
        with warnings.catch_warnings():  # read-only memmaps: the kernels never write weights
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(data))
    if qtype in KQUANT_QTYPES:
        return _pack_kquant(qtype, data, n, k)
    if qtype == "f32":
        if data.dtype != torch.float32:
            raise TypeError(f"f32 weight must be float32, got {data.dtype}")
        if data.numel() != n * k:
            raise ValueError(f"f32 weight has {data.numel()} elements, expected {n}x{k}")
        return PackedWeight(qtype, n, k, data.reshape(n, k).contiguous())
    if k % BLOCK_SIZE:
        raise ValueError(f"{qtype} needs in_features divisible by {BLOCK_SIZE}, got {k}")
    return PackedWeight(qtype, n, k, _block_rows(qtype, data, n, k))


def _as_bytes(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The bytes of an array or tensor as a flat uint8 tensor (a view where the memory is
    contiguous; read-only memory maps included: the kernels never write weights)."""
    if isinstance(a, np.ndarray):
        a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    return a.contiguous().reshape(-1).view(torch.uint8)


def half_storage(qtype: str, parts: list[np.ndarray] | list[torch.Tensor]) -> torch.Tensor:
    """16-bit weight rows, one part after the other, in one new flat tensor of ``qtype``'s torch
    dtype (huge-page backed with the native extension): each 16-bit value copied once, never
    widened.  Parts hold 16-bit values (float16, bfloat16, uint16 bit patterns) or their bytes
    (uint8, as GGUF BF16 tensors come)."""
    if qtype not in HALF_QTYPES:
        raise ValueError(f"half_storage takes {HALF_QTYPES}, got {qtype!r}")
    chunks = [_as_bytes(p) for p in parts]
    out = _C.weight_cat(chunks) if _C is not None else torch.cat(chunks)
    return out.view(HALF_DTYPES[qtype])


def _block_rows(qtype: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """GGUF block bytes as [n, row bytes], checked."""
    if data.dtype != torch.uint8:
        raise TypeError(f"{qtype} weight must be uint8 GGUF block bytes, got {data.dtype}")
    rb = _row_bytes(qtype, k)
    if data.numel() != n * rb:
        raise ValueError(
            f"{qtype} weight has {data.numel()} bytes, expected {n} rows x {rb} bytes ({n}x{k})"
        )
    return data.reshape(n, rb).contiguous()


def _pack_kquant(qtype: str, data: torch.Tensor, n: int, k: int) -> PackedWeight:
    if not kquant_supported(qtype, n, k):
        reason = "the native extension" if _C is None else "N % 16 == 0 and K % 256 == 0"
        raise ValueError(f"{qtype} weights [{n}, {k}] need {reason}")
    tiles = _C.repack_kq(_block_rows(qtype, data, n, k), _QT_CODE[qtype], n, k)
    return PackedWeight(qtype, n, k, tiles, parts=((qtype, n),))


def pack_kquants(parts: list[tuple[str, np.ndarray | torch.Tensor, int]], k: int) -> PackedWeight:
    """Several K-quant weights ``(qtype, GGUF block bytes, out_features)`` of one
    ``in_features``, fused along out_features and repacked straight into one buffer (what
    ``concat_weights`` of each ``pack_weight`` gives, without the copy)."""
    tensors, codes, ns = [], [], []
    for qtype, data, n in parts:
        if not kquant_supported(qtype, n, k):
            reason = "the native extension" if _C is None else "N % 16 == 0 and K % 256 == 0"
            raise ValueError(f"{qtype} weights [{n}, {k}] need {reason}")
        if isinstance(data, np.ndarray):
            with warnings.catch_warnings():  # read-only memmaps: the kernels never write weights
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(np.ascontiguousarray(data))
        tensors.append(_block_rows(qtype, data, n, k))
        codes.append(_QT_CODE[qtype])
        ns.append(n)
    layout = tuple((qtype, n) for qtype, _, n in parts)
    if len(parts) == 1:
        return PackedWeight(parts[0][0], ns[0], k, _C.repack_kq(tensors[0], codes[0], ns[0], k),
                            parts=layout)  # fmt: skip
    data = _C.repack_kq_cat(tensors, codes, ns, k)
    return PackedWeight(_kquant_qtype(layout), sum(ns), k, data, parts=layout)


def _kquant_qtype(parts: tuple[tuple[str, int], ...]) -> str:
    return "+".join(dict.fromkeys(fmt for fmt, _ in parts))


def concat_weights(weights: list[PackedWeight] | tuple[PackedWeight, ...]) -> PackedWeight:
    """Stack weights with the same qtype and in_features along out_features (fused QKV, gate/up).

    Output rows are computed independently, so a fused call gives bit-identical rows to separate
    calls with the native kernels.
    """
    if not weights:
        raise ValueError("concat_weights needs at least one weight")
    qtype, k = weights[0].qtype, weights[0].in_features
    if all(w.is_kquant for w in weights) and all(w.in_features == k for w in weights):
        # K-quant formats mix: each part keeps its own tiles
        parts = tuple(p for w in weights for p in w.parts)
        n = sum(w.out_features for w in weights)
        data = _C.weight_cat([w.data for w in weights])
        return PackedWeight(_kquant_qtype(parts), n, k, data, parts=parts)
    for w in weights:
        if w.qtype != qtype or w.in_features != k:
            raise ValueError(
                f"cannot concatenate {w.qtype} [{w.out_features}, {w.in_features}] with "
                f"{qtype} [*, {k}]"
            )
    n = sum(w.out_features for w in weights)
    if qtype in HALF_QTYPES:
        return PackedWeight(qtype, n, k, half_storage(qtype, [w.data for w in weights]).view(n, k))
    return PackedWeight(qtype, n, k, torch.cat([w.data for w in weights], dim=0))


def _roundf(x: torch.Tensor) -> torch.Tensor:
    # Round half away from zero, exactly as gguf.quants.np_roundf.
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def _quantize_blocks(qtype: str, b: torch.Tensor) -> torch.Tensor:
    """float32 [nb, 32] -> uint8 [nb, block_bytes], the same float32 steps as gguf.quants."""
    zero = torch.zeros((), dtype=torch.float32, device=b.device)
    if qtype == "q8_0":
        d = b.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, zero, 1 / d)
        qs = _roundf(b * inv).to(torch.int8).view(torch.uint8)
        return torch.cat([d.to(torch.float16).view(torch.uint8), qs], dim=-1)
    if qtype == "q4_0":
        imax = b.abs().argmax(dim=-1, keepdim=True)
        mx = torch.gather(b, -1, imax)
        d = mx / -8
        inv = torch.where(d == 0, zero, 1 / d)
        qs = torch.trunc(b * inv + 8.5).to(torch.uint8).clamp(0, 15)
        head = [d.to(torch.float16).view(torch.uint8)]
    elif qtype == "q4_1":
        mx = b.amax(dim=-1, keepdim=True)
        mn = b.amin(dim=-1, keepdim=True)
        d = (mx - mn) / 15
        inv = torch.where(d == 0, zero, 1 / d)
        qs = torch.trunc((b - mn) * inv + 0.5).to(torch.uint8).clamp(0, 15)
        head = [d.to(torch.float16).view(torch.uint8), mn.to(torch.float16).view(torch.uint8)]
    else:
        raise ValueError(f"cannot quantize to {qtype!r}")
    packed = qs[:, :16] | (qs[:, 16:] << 4)
    return torch.cat([*head, packed], dim=-1)


def quantize_weight(w: torch.Tensor, qtype: str) -> PackedWeight:
    """Quantize a float ``[N, K]`` weight to any QTYPE (GGUF block formats, gguf's rounding)."""
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {QTYPES}")
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    w = w.detach().to(torch.float32)
    if qtype == "f32":
        return pack_weight("f32", w.contiguous(), n, k)
    if k % BLOCK_SIZE:
        raise ValueError(f"{qtype} needs in_features divisible by {BLOCK_SIZE}, got {k}")
    rb = _row_bytes(qtype, k)
    out = torch.empty((n, rb), dtype=torch.uint8, device=w.device)
    rows = max(1, (1 << 20) // k)  # bound the temporaries
    for r0 in range(0, n, rows):
        chunk = w[r0 : r0 + rows].reshape(-1, BLOCK_SIZE)
        out[r0 : r0 + rows] = _quantize_blocks(qtype, chunk).reshape(-1, rb)
    return pack_weight(qtype, out, n, k)


# ---------------------------------------------------------------------------------------------
# Ops


class KernelOps:
    """Interface of the kernel implementations.  See :func:`get_ops`."""

    name: str = "abstract"
    # Whether decoder_layer() exists: one call per layer instead of the Python op sequence.
    supports_fused_layers: bool = False
    # Key cache layout these ops read: 0 = [Hkv, L, D]; B > 0 = blocked and transposed,
    # [Hkv, ceil(L / B), D, B] (see specdec.kv_cache.pool).  attention() takes either.
    key_block: int = 0
    # Positions per attention block of the fused layers (kAttnBlock): shared prefixes come in
    # whole blocks.  0: no fused layers.
    attn_block: int = 0

    def linear(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [M, K]`` float32 -> ``x @ W.T (+ bias)``, ``[M, N]``."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x * rsqrt(mean(x^2, -1) + eps) * weight`` over the last dimension."""
        raise NotImplementedError

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start_pos: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention of one sequence's ``T`` new rows over its KV cache.

        ``q [T, H, D]`` holds positions ``start_pos .. start_pos + T - 1``; ``k_cache`` and
        ``v_cache`` are ``[Hkv, L, D]`` with entries ``0 .. start_pos + T - 1`` valid (the new
        tokens included); ``k_cache`` may instead be in the ops' ``key_block`` layout
        (``[Hkv, ceil(L / B), D, B]``), which the engine's caches use.  Row ``t`` attends keys
        ``j <= start_pos + t`` (and, with ``sliding_window > 0``, only
        ``start_pos + t - j < sliding_window``).  Query head ``h``
        uses kv head ``h // (H // Hkv)``.  ``softcap > 0`` maps scaled scores ``s`` to
        ``softcap * tanh(s / softcap)`` before the softmax.  Returns ``[T, H, D]``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _kernel_weight(w: PackedWeight) -> tuple[torch.Tensor, int, list[int]]:
    """The tensor, qtype code and parts _C.linear takes for ``w`` (8-bit activations when
    enabled)."""
    code = w.qtype_code
    if w.x2_tiles is not None:  # flat tiles: the rows ride in parts, as K-quants' do
        return w.x2_tiles, code, [_QT_CODE[w.qtype], w.out_features]
    if w.a8 is not None:
        return w.a8, int(_C.QT_A8_BASE) + code, w.part_codes()
    return w.data, code, w.part_codes()


class NativeOps(KernelOps):
    """C++ kernels (CPU, float32).  Batch-invariant: rows never depend on the other rows."""

    name = "native"

    def __init__(self) -> None:
        if _C is None:
            raise RuntimeError(
                f"native kernels unavailable ({native_unavailable_reason()}); build them with "
                "`pip install --no-build-isolation -e .`"
            )
        self._C = _C
        self.key_block = int(_C.KEY_BLOCK)  # kKeyBlock of kernels.h
        self.attn_block = int(_C.ATTN_BLOCK)  # kAttnBlock

    @property
    def isa(self) -> str:
        return self._C.isa()

    def linear(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        data, code, parts = _kernel_weight(w)
        if x.dim() == 2:
            return self._C.linear(x, data, code, w.out_features, w.in_features, bias, parts)
        lead = x.shape[:-1]
        y = self._C.linear(
            x.reshape(-1, x.shape[-1]), data, code, w.out_features, w.in_features, bias, parts
        )
        return y.reshape(*lead, w.out_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._C.rms_norm(x, weight, float(eps))

    supports_fused_layers = True

    def decoder_layer(self, cfg: Any, index: int, lw: Any) -> Any:
        """A whole decoder layer as one native call (``_C.DecoderLayer``).

        ``cfg`` is the model's ArchConfig and ``lw`` its LayerWeights for layer ``index``; the
        result's ``forward(x, cos, sin, k_cache, v_cache, slots, starts, counts)`` computes what
        ``LlamaModel._layer`` computes, bit for bit.
        """

        def lin(prefix: str, linear: Any) -> dict[str, Any]:
            if linear is None:  # a mixture-of-experts layer's dense feed-forward: none
                data, code, parts, bias = torch.empty(0, dtype=torch.uint8), 0, [], None
            else:
                (data, code, parts), bias = _kernel_weight(linear.weight), linear.bias
            return {
                f"{prefix}_w": data,
                f"{prefix}_qt": code,
                f"{prefix}_bias": bias,
                f"{prefix}_parts": parts,
            }

        layer = self._C.DecoderLayer(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            eps=float(cfg.rms_norm_eps),
            attn_scale=float(cfg.attn_scale),
            sliding_window=int(cfg.layer_window(index)),
            softcap=float(cfg.attn_logit_softcapping),
            activation="gelu_tanh" if cfg.is_gemma else "silu",
            input_norm=lw.input_norm,
            post_attn_norm=lw.post_attn_norm,
            q_norm=lw.q_norm,
            k_norm=lw.k_norm,
            post_attn_out_norm=lw.post_attn_out_norm,
            post_ffw_norm=lw.post_ffw_norm,
            **lin("qkv", lw.qkv),
            **lin("o", lw.o_proj),
            **lin("gate_up", lw.gate_up),
            **lin("down", lw.down),
        )
        if lw.moe is not None:
            layer.set_moe(self.moe_ffn(lw.moe))
        return layer

    def linear_spec(self, linear: Any) -> Any:
        """``linear`` as the native layers take it (``_C.LinearSpec``)."""
        data, code, parts = _kernel_weight(linear.weight)
        return self._C.LinearSpec(data, code, linear.weight.in_features, linear.bias, parts)

    def moe_ffn(self, moe: Any) -> Any:
        """A ``MoeBlock`` (model/moe.py) as one native call (``_C.MoeFfn``): the same bits."""
        spec = self.linear_spec
        shared = moe.shared is not None and moe.shared_gate is not None
        return self._C.MoeFfn(
            router=spec(moe.router),
            gate_up=[spec(e.gate_up) for e in moe.experts],
            down=[spec(e.down) for e in moe.experts],
            top_k=moe.top_k,
            norm_topk_prob=moe.norm_topk_prob,
            shared_gate_up=spec(moe.shared.gate_up) if shared else None,
            shared_down=spec(moe.shared.down) if shared else None,
            shared_gate=spec(moe.shared_gate) if shared else None,
            grouped=moe.grouped,
        )

    def forward_layers(
        self,
        layers: list[Any],
        x: torch.Tensor,
        cos: list[torch.Tensor],
        sin: list[torch.Tensor],
        rope: list[int],
        k_caches: torch.Tensor,
        v_caches: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        capture: list[int],
        reducer: Any = None,
        prefix_slots: Sequence[int] = (),
        prefix_lens: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``decoder_layer`` results run in order in one native call: the last one's output, and
        the input of each layer index in ``capture``. ``rope[i]`` picks layer i's (cos, sin).
        ``reducer`` (a ``_C.ShmReducer``, tensor parallelism) sums the ranks' o_proj and
        down_proj outputs inside each layer. ``prefix_slots`` / ``prefix_lens``: shared prefixes
        (``SeqBatch``), read once for every sequence on the same one."""
        return self._C.forward_layers(
            layers, x, cos, sin, rope, k_caches, v_caches, slots, starts, counts, capture, reducer,
            list(prefix_slots), list(prefix_lens),
        )  # fmt: skip

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start_pos: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if k_cache.dim() == 3 and k_cache.dtype != torch.int8:  # [Hkv, L, D]: blocked (a copy)
            k_cache = blocked_keys(k_cache, self.key_block)
        return self._C.attention(
            q, k_cache, v_cache, int(start_pos), float(scale), int(sliding_window), float(softcap)
        )


class TorchOps(KernelOps):
    """Pure PyTorch ops; run on the device of their inputs (CPU or CUDA).

    Quantized weights are dequantized once, lazily, to a float copy cached on the PackedWeight
    (per device), then used with ``F.linear``: this path is for CUDA and for debugging, not for
    speed or memory on CPU.  Results are not batch-invariant.
    """

    name = "torch"

    def linear(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = w.float_weight(x.device)
        if x.dtype != weight.dtype:  # bfloat16 / float16 activations: a cached cast of the weight
            key = f"{x.device}:{x.dtype}"
            cast = w._float_cache.get(key)
            if cast is None:
                cast = w._float_cache[key] = weight.to(x.dtype)
            weight = cast
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:  # half precision: normalise in float32, return the input dtype
            return self.rms_norm(x.float(), weight.float(), eps).to(x.dtype)
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start_pos: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        t, h, d = q.shape
        hkv = k_cache.shape[0]
        g = h // hkv
        n = start_pos + t
        device = q.device
        k = k_cache[:, :n].to(q.dtype)  # [Hkv, n, D]; a 16-bit cache (kv_cache_dtype) widens here
        v = v_cache[:, :n].to(q.dtype)
        qg = q.reshape(t, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, T, D]
        scores = torch.matmul(qg, k.transpose(1, 2).unsqueeze(1)) * scale  # [Hkv, g, T, n]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(start_pos, n, device=device).unsqueeze(1)  # [T, 1]
        j = torch.arange(n, device=device).unsqueeze(0)  # [1, n]
        allowed = j <= pos
        if sliding_window > 0:
            allowed = allowed & (pos - j < sliding_window)
        scores = scores.masked_fill(~allowed, -math.inf)
        p = torch.softmax(scores, dim=-1)
        out = torch.matmul(p, v.unsqueeze(1))  # [Hkv, g, T, D]
        return out.permute(2, 0, 1, 3).reshape(t, h, d)


_OPS: dict[str, KernelOps] = {}


def get_ops(name: str = "auto", device: torch.device | str = "cpu") -> KernelOps:
    """Pick kernels: "auto" (native on CPU when built, else torch), "torch" or "native"."""
    dev = torch.device(device)
    if name == "auto":
        name = "native" if dev.type == "cpu" and _C is not None else "torch"
    if name == "torch":
        if "torch" not in _OPS:
            _OPS["torch"] = TorchOps()
        return _OPS["torch"]
    if name == "native":
        if dev.type != "cpu":
            raise RuntimeError(f"native kernels run on the CPU only, not on {dev}; use 'torch'")
        if "native" not in _OPS:
            _OPS["native"] = NativeOps()
        return _OPS["native"]
    raise ValueError(f"unknown kernel ops {name!r}; expected 'auto', 'torch' or 'native'")
