"""The weight formats the kernels take: their names, GGUF block sizes, the codes ``_C`` knows them
by, and the reference conversions between them and float32 (gguf's rounding, bit for bit)."""

from __future__ import annotations

import torch

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


def _row_bytes(qtype: str, in_features: int) -> int:
    if qtype == "f32":
        return in_features * 4
    if qtype in KQUANT_QTYPES:
        return in_features // KQUANT_BLOCK * KQUANT_GGUF_BYTES[qtype]
    return in_features // BLOCK_SIZE * BLOCK_BYTES[qtype]


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
