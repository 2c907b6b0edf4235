"""Kernel library: weight-only linear layers (f32 and GGUF block formats), RMS norm, attention.

Two implementations of one interface (:class:`KernelOps`):

* :class:`NativeOps` -- the C++ extension ``specdec.kernels._C`` (AVX-512 or AVX2/FMA/F16C kernels
  picked at runtime, portable C++ otherwise).  Every op is *batch-invariant*: row ``r`` of an ``M``-row call
  is bit-identical to the same row computed alone, whatever ``M`` and the thread count.  That is
  what lets speculative verification (several rows) and plain decoding (one row) agree exactly.
* :class:`TorchOps` -- plain PyTorch, works on any device (CUDA included).  Not batch-invariant;
  meant for GPUs, debugging and as a reference.

Use :func:`get_ops` to pick one.

Modules: ``native`` (the extension's import and what it runs here), ``formats`` (weight formats and
their reference conversions), ``weights`` (:class:`PackedWeight` and its makers), ``ops`` (the two
implementations).  Every name is re-exported here; the choices that depend on what runs here
(:func:`int8_activations_pay`, :func:`kquant_native_preferred`) live here, reading this module's
capability functions.
"""

from __future__ import annotations

from specdec.kernels.formats import (
    _QT_CODE,
    A8_QTYPES,
    BLOCK_BYTES,
    BLOCK_SIZE,
    HALF_DTYPES,
    HALF_QTYPES,
    KQUANT_BLOCK,
    KQUANT_GGUF_BYTES,
    KQUANT_QTYPES,
    KQUANT_TILE_BYTES,
    QTYPES,
    _dequantize,
)
from specdec.kernels.native import (
    _C,
    a8_kernels,
    a8_walk,
    amx16_available,
    amx_available,
    cpu_features,
    int8_activations_fast,
    kquant_float_fast,
    kquant_int8_fast,
    kquant_supported,
    native_available,
    native_isa,
    native_module,
    native_unavailable_reason,
    set_native_amx,
    set_native_isa,
)
from specdec.kernels.ops import (
    KernelOps,
    NativeOps,
    TorchOps,
    _kernel_weight,
    get_ops,
)
from specdec.kernels.weights import (
    PackedWeight,
    concat_weights,
    half_storage,
    pack_kquants,
    pack_weight,
    quantize_weight,
)

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
# Re-exported as well, for the model loader, tests and benchmarks.
__all__ += [
    "BLOCK_BYTES",
    "BLOCK_SIZE",
    "HALF_DTYPES",
    "KQUANT_BLOCK",
    "KQUANT_GGUF_BYTES",
    "KQUANT_TILE_BYTES",
    "_C",
    "_QT_CODE",
    "_dequantize",
    "_kernel_weight",
    "a8_kernels",
    "a8_walk",
    "amx_available",
    "half_storage",
    "native_module",
    "native_unavailable_reason",
    "pack_kquants",
    "set_native_amx",
]


def int8_activations_pay(qtype: str) -> bool:
    """Whether the 8-bit activation kernels beat the float ones on weights of ``qtype`` here:
    every format with VNNI (AVX-512, or 256-bit: AVX-VNNI); with AVX2 alone the 4-bit ones only
    (a Q8_0 code takes two vpmaddubsw, about what the float kernels spend: gemma3-270m's Q8_0
    layers ran 8 rows 0.9x and 256 rows 0.74x float32's speed, SmolLM2's Q4_1 ones 1.9x and 1.5x;
    one vpdpbusd takes it: SmolLM2's Q8_0 output layer 2.1-2.4x faster at 8 and 16 rows)."""
    if all(part in KQUANT_QTYPES for part in qtype.split("+")):  # "q4_k+q6_k": fused parts
        return kquant_int8_fast()
    if not int8_activations_fast():
        return False
    return _C.a8_kernels() != "avx2" or qtype in ("q4_0", "q4_1")


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
