"""Weights in kernel-ready storage: :class:`PackedWeight`, and the ways one is made (GGUF blocks,
16-bit rows, K-quant tiles, fused parts, quantization of a float weight)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from specdec.kernels.formats import (
    _QT_CODE,
    _QT_KQUANT,
    _QT_X2_CODE,
    A8_QTYPES,
    BLOCK_SIZE,
    HALF_DTYPES,
    HALF_QTYPES,
    KQUANT_QTYPES,
    QTYPES,
    _dequantize,
    _quantize_blocks,
    _row_bytes,
)
from specdec.kernels.native import _C, amx16_available, kquant_supported


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

    def shape_str(self) -> str:
        """``qtype [out_features, in_features]``, as messages name the weight."""
        return f"{self.qtype} [{self.out_features}, {self.in_features}]"

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
                f"out_features % 16 == 0 on CPU, got {self.shape_str()}"
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
                f"{self.shape_str()}"
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
        idx = rows if rows.dim() == 1 else rows.reshape(-1)
        if idx.device != self.device:
            idx = idx.to(self.device)
        if self.x2_tiles is not None:  # only the tiles: unpack just these rows
            rows16 = _C.unpack_x2(
                self.x2_tiles, _QT_CODE[self.qtype], self.out_features, self.in_features, idx
            )
            return rows16.float()
        if self._data is None:  # only the (q8_0 / q4_0 / q4_1) tiles: these rows, one native call
            return _C.dequantize_a8_rows(
                self.a8, _QT_CODE[self.qtype], self.out_features, self.in_features, idx
            )
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
            raise ValueError(f"cannot concatenate {w.shape_str()} with {qtype} [*, {k}]")
    n = sum(w.out_features for w in weights)
    if qtype in HALF_QTYPES:
        return PackedWeight(qtype, n, k, half_storage(qtype, [w.data for w in weights]).view(n, k))
    return PackedWeight(qtype, n, k, torch.cat([w.data for w in weights], dim=0))


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
