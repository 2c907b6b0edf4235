"""The compiled extension ``specdec.kernels._C``: its import (optional: without it the torch ops
serve) and what it can run on this machine (instruction sets, 8-bit and bf16x2 kernels, AMX)."""

from __future__ import annotations

import os
import types

from specdec.kernels.formats import KQUANT_BLOCK, KQUANT_QTYPES

try:
    from specdec.kernels import _C

    _IMPORT_ERROR: BaseException | None = None
except Exception as exc:  # extension not built, or built against another torch
    _C = None
    _IMPORT_ERROR = exc


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


def a8_walk() -> str | None:
    """How the VNNI kernels walk a product: 'groups' (Intel) or 'stationary' (AMD).

    The same results either way; ``SPECDEC_A8_WALK`` picks one from the start.
    """
    return _C.a8_walk() if _C is not None and hasattr(_C, "a8_walk") else None


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


def kquant_supported(qtype: str, out_features: int, in_features: int) -> bool:
    """Whether a GGUF K-quant weight of this shape can stay native (pack_weight takes it)."""
    return (
        _C is not None
        and qtype in KQUANT_QTYPES
        and out_features % 16 == 0
        and in_features % KQUANT_BLOCK == 0
    )
