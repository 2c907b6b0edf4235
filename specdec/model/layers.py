"""Building blocks shared by the model families: linear layers and rotary embeddings.

Every linear layer goes through :class:`Linear`, the single entry point where the kernel
backend (native C++ or torch) is chosen.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

from specdec.kernels import (
    A8_QTYPES,
    HALF_QTYPES,
    KQUANT_QTYPES,
    QTYPES,
    KernelOps,
    PackedWeight,
    half_storage,
    kquant_native_preferred,
    pack_kquants,
    pack_weight,
    quantize_weight,
)
from specdec.model.loader import RawTensor, mapped_pages

QUANTIZATION_CHOICES = ("auto", "fp32", "q8_0", "q4_0", "q4_1")
_PRECISION = ("q4_0", "q4_1", "q8_0", "f32")  # least to most precise


class Linear:
    """y = x W^T (+ b) through the kernel backend."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None, ops: KernelOps) -> None:
        self.weight = weight
        self.bias = bias
        self.ops = ops

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return self.ops.linear(x, self.weight, self.bias)


def _target_qtype(raw: RawTensor, quantization: str, native: bool, a8: bool) -> str:
    if not native or quantization == "fp32":
        return "f32"
    if quantization != "auto":
        return quantization
    if raw.qtype in QTYPES or raw.qtype in HALF_QTYPES:  # NOTE: 16-bit stays 16-bit
        return raw.qtype
    if len(raw.shape) == 2 and kquant_native_preferred(raw.qtype, raw.shape[0], raw.shape[1], a8):
        return raw.qtype
    # NOTE: formats without a native kernel (Q5_x; K-quants of odd shapes, or on AVX2 with
    # float activations) go to Q8_0: near-lossless.
    return "q8_0" if raw.is_quantized else "f32"


def pack_linear(
    raws: list[RawTensor],
    quantization: str,
    ops: KernelOps,
    device: torch.device,
    a8: bool = False,
) -> PackedWeight:
    """Pack one weight, or several fused along the output dimension (q|k|v, gate|up).

    ``a8``: the 8-bit activation kernels will run it; a q8_0 / q4_0 / q4_1 weight is then
    repacked for them straight from the file's blocks, part by part, and the blocks are not
    kept (each weight stored once; the model's peak while loading stays near its final size).
    """
    native = ops.name == "native"
    kinds = [_target_qtype(r, quantization, native, a8) for r in raws]
    if all(k in KQUANT_QTYPES for k in kinds) and all(r.shape[1] == raws[0].shape[1] for r in raws):
        # kept as they are (formats may differ by part), repacked straight into one buffer;
        # each part's file pages are mapped in one call and dropped once repacked
        with mapped_pages(raws):
            return pack_kquants([(r.qtype, r.data, r.shape[0]) for r in raws], raws[0].shape[1])
    if len(set(kinds)) == 1 and kinds[0] in HALF_QTYPES and all(r.qtype == kinds[0] for r in raws):
        with mapped_pages(raws):
            data = half_storage(kinds[0], [r.data for r in raws])  # one copy of the 16-bit values
        n = sum(r.shape[0] for r in raws)
        return pack_weight(kinds[0], data.view(n, raws[0].shape[1]), n, raws[0].shape[1])
    # NOTE: a K-quant fused with a part of another format goes to Q8_0 with the rest.
    # NOTE: 16-bit parts fused with parts of another format widen to float32 with the rest.
    targets = {"q8_0" if k in KQUANT_QTYPES else "f32" if k in HALF_QTYPES else k for k in kinds}
    in_features = raws[0].shape[1]
    out_features = sum(r.shape[0] for r in raws)
    if (
        len(targets) == 1
        and all(r.qtype == next(iter(targets)) for r in raws)
        and raws[0].is_quantized
    ):
        if a8 and native and raws[0].qtype in A8_QTYPES and out_features % 16 == 0:
            return _pack_a8_parts(raws, in_features)
        data = np.concatenate([r.data.reshape(r.shape[0], -1) for r in raws], axis=0)
        return pack_weight(
            raws[0].qtype, torch.from_numpy(np.ascontiguousarray(data)), out_features, in_features
        )
    w = torch.cat([r.to_float() for r in raws], dim=0)  # [N, K]
    target = max(targets, key=_PRECISION.index)  # fused parts of mixed formats: the most precise
    if target == "f32":
        # NOTE: weights stay float32; the torch kernels cast them once per activation dtype.
        return pack_weight("f32", w.to(device=device).contiguous(), out_features, in_features)
    return quantize_weight(w, target)


def _pack_a8_parts(raws: list[RawTensor], in_features: int) -> PackedWeight:
    with mapped_pages(raws), warnings.catch_warnings():  # read-only memmaps: nothing writes them
        warnings.simplefilter("ignore", UserWarning)
        parts = [torch.from_numpy(r.data.reshape(r.shape[0], -1)) for r in raws]
        return PackedWeight.from_a8_parts(
            raws[0].qtype, parts, [r.shape[0] for r in raws], in_features
        )


def make_linear(
    raws: list[RawTensor],
    biases: list[RawTensor | None],
    quantization: str,
    ops: KernelOps,
    dtype: torch.dtype,
    device: torch.device,
    a8: bool = False,
    packed: PackedWeight | None = None,
) -> Linear:
    """``packed``: the weight already packed (the weight cache's), else packed from ``raws``."""
    weight = packed if packed is not None else pack_linear(raws, quantization, ops, device, a8)
    bias = None
    if any(b is not None for b in biases):
        parts = [
            b.to_float() if b is not None else torch.zeros(r.shape[0]) for r, b in zip(raws, biases)
        ]
        bias = torch.cat(parts).to(device=device, dtype=dtype)
    return Linear(weight, bias, ops)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, freq_factors: torch.Tensor | None
) -> torch.Tensor:  # [head_dim // 2] float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        return inv_freq / freq_factors.float()
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class Rotary:
    """Half-split (NeoX / Hugging Face) rotary embedding with cos/sin tables per position.

    On the CPU the tables cover the positions read so far (``cover`` grows them, doubling, up to
    ``max_len``); elsewhere, and through ``cos`` / ``sin``, all ``max_len`` positions. A
    position's row is the same either way (each element is its own product and cos / sin).
    NOTE: full tables of Gemma 3 270M's 256-wide heads at its 4,096 positions, for its two
    rotary bases, held 16 MiB (Qwen3's at 40,960 positions: 40 MiB) that short requests never
    read."""

    FIRST_ROWS = 1024

    def __init__(
        self, inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device: torch.device
    ):
        self.inv_freq, self.max_len = inv_freq, max_len
        self.dtype, self.device = dtype, torch.device(device)
        rows = max_len if self.device.type != "cpu" else min(max_len, self.FIRST_ROWS)
        self._cos, self._sin = self._tables(rows)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:  # [P] -> [P, D] float32
        freqs = torch.outer(positions.to(torch.float32), self.inv_freq)  # [P, D/2]
        return torch.cat([freqs, freqs], dim=-1)

    def _tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self._angles(torch.arange(rows))  # [rows, D]
        return (
            emb.cos().to(device=self.device, dtype=self.dtype),
            emb.sin().to(device=self.device, dtype=self.dtype),
        )

    def cover(self, rows: int) -> None:
        """Tables of at least ``rows`` positions (up to ``max_len``)."""
        if rows > self._cos.shape[0]:
            self._cos, self._sin = self._tables(
                min(self.max_len, max(rows, 2 * self._cos.shape[0]))
            )

    @property
    def cos(self) -> torch.Tensor:  # [max_len, D]
        self.cover(self.max_len)
        return self._cos

    @property
    def sin(self) -> torch.Tensor:  # [max_len, D]
        self.cover(self.max_len)
        return self._sin

    def tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables ``[rows, D]``, grown to cover positions ``[0, end)`` first."""
        self.cover(end)
        return self._cos, self._sin

    def at(
        self, positions: torch.Tensor, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of ``positions`` ([T] -> two [T, D]); ``end``: one past the largest
        position when the caller knows it (else read from ``positions``)."""
        if end is None and self.device.type == "cpu" and positions.numel():
            end = int(positions.max()) + 1
        if end is not None:
            self.cover(end)
        return self._cos[positions], self._sin[positions]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, H, D]; positions [T]
        cos, sin = self.at(positions)
        return _rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))  # cos / sin [T, 1, D]

    def rotate_each(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` rotated to each of ``positions [P]``: ``[P, ..., D]`` float32, from
        the frequencies, without growing the tables to those positions (statistics over a
        whole context: LlamaModel.measure_key_transform)."""
        emb = self._angles(positions).view(len(positions), *([1] * (x.dim() - 1)), x.shape[-1])
        return _rotate(x.float(), emb.cos(), emb.sin())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of ``x [..., D]`` by ``cos`` / ``sin`` broadcast against it."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
