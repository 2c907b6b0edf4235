"""Build of the optional native extensions ``specdec.kernels._C``,
``specdec.spec_decode._suffix_native`` and ``specdec.model._spm_native``.

Project metadata lives in pyproject.toml; this file only adds the C++ extensions:

* ``specdec/kernels/csrc/ops.cpp`` (torch binding), ``layer.cpp`` (a whole decoder layer in one
  call), ``moe.cpp`` (its mixture-of-experts feed-forward), ``head.cpp`` (EAGLE-3's draft head), ``kernels_portable.cpp`` and ``kquants.cpp``
  (K-quant tiles) are compiled with the flags torch's ``BuildExtension`` uses (no ISA flags), so
  the module imports on any x86-64 CPU;
* ``kernels_avx2.cpp``, ``kernels_avx2_a8.cpp`` (8-bit activations on AVX2) and
  ``kernels_avx2_kq.cpp`` (the same for K-quants) are compiled on their own with ``-mavx2 -mfma -mf16c -O3``, and
  ``kernels_avx512.cpp`` with AVX-512 F/DQ/BW/VL added, ``kernels_vnni.cpp`` (8-bit activation
  kernels) with VNNI on top, ``kernels_amx.cpp`` (the same kernels on AMX-INT8 tiles) with
  ``-mamx-tile -mamx-int8`` on top of that, ``kernels_amx16.cpp`` (16-bit weights with bf16x2
  activations on AMX-BF16 tiles) with ``-mavx512bf16 -mamx-tile -mamx-bf16``,
  ``kernels_avxvnni.cpp`` (the AVX2 8-bit activation kernels on AVX-VNNI's vpdpbusd) with
  ``-mavxvnni`` and ``kernels_avx2_vnni_evex.cpp`` (the same code in AVX-512 VNNI's 256-bit form)
  with AVX-512 F/VL/VNNI, and all are linked in; the binding only calls them
  after CPUID says the CPU has those instructions (and, for AMX, the kernel has granted the
  tile state);
* ``specdec/spec_decode/csrc/suffix_tree.cpp`` (suffix decoding's trees, a pybind11 module) is
  plain C++17 at ``-O3`` with no ISA flags, and links no torch library;
* ``specdec/model/csrc/spm_bpe.cpp`` (``specdec.model._spm_native``: the compact SentencePiece
  tokenizer for Gemma's vocabularies) likewise.

The extensions are optional: when torch's build helpers are missing or any compile step fails,
the build prints a warning and the package installs without it (``specdec.kernels`` then falls back
to its pure-torch implementation, suffix decoding to its Python trees, Gemma's tokenizer to the
``tokenizers`` library's).  Set
``SPECDEC_NO_EXTENSION=1`` to skip the build on purpose.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

from setuptools import setup

CSRC = os.path.join("specdec", "kernels", "csrc")
SUFFIX_CSRC = os.path.join("specdec", "spec_decode", "csrc")
SPM_CSRC = os.path.join("specdec", "model", "csrc")
KERNELS_EXT = "specdec.kernels._C"
COMMON_FLAGS = ["-O3", "-g0", "-ffp-contract=off"]
AVX2_FLAGS = ["-O3", "-g0", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-std=c++17"]
AVX512_FLAGS = AVX2_FLAGS + ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"]
# GCC 12 warns about its own _mm512_setzero_ps (a false positive).
AVX512_FLAGS += ["-Wno-uninitialized", "-Wno-maybe-uninitialized"]
# ISA units compiled on their own, in order; each needs the ones before it (the AVX-512 table
# reuses the AVX2 rms_norm and attention merge).
ISA_UNITS = [
    ("AVX2", "kernels_avx2.cpp", AVX2_FLAGS, "SPECDEC_HAVE_AVX2"),
    # 8-bit activation kernels on AVX2 (vpmaddubsw), bit-identical to the VNNI ones
    ("AVX2 8-bit activations", "kernels_avx2_a8.cpp", AVX2_FLAGS, "SPECDEC_HAVE_AVX2A8"),
    # K-quant 8-bit activation kernels on AVX2, bit-identical to the VNNI ones
    ("AVX2 K-quants", "kernels_avx2_kq.cpp", AVX2_FLAGS, "SPECDEC_HAVE_AVX2KQ"),
    # The attention blocks on 16 lanes, bit-identical to the AVX2 ones (the AVX-512 table's).
    ("AVX-512 attention", "attention_avx512.cpp", AVX512_FLAGS, "SPECDEC_HAVE_AVX512ATTN"),
    ("AVX-512", "kernels_avx512.cpp", AVX512_FLAGS, "SPECDEC_HAVE_AVX512"),
    ("AVX-512 VNNI", "kernels_vnni.cpp", AVX512_FLAGS + ["-mavx512vnni"], "SPECDEC_HAVE_VNNI"),
    ("AVX-512 16-bit weights", "kernels_bf16.cpp", AVX512_FLAGS, "SPECDEC_HAVE_HALF512"),
    # Needs the VNNI unit (it hands few-row calls to the VNNI kernels); GCC >= 11.
    (
        "AMX-INT8",
        "kernels_amx.cpp",
        AVX512_FLAGS + ["-mavx512vnni", "-mamx-tile", "-mamx-int8"],
        "SPECDEC_HAVE_AMX",
    ),
    # 16-bit weights with bf16x2 activations on AMX-BF16 tiles (GCC >= 11).
    (
        "AMX-BF16",
        "kernels_amx16.cpp",
        AVX512_FLAGS + ["-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
        "SPECDEC_HAVE_AMX16",
    ),
    # 8-bit activations on 256-bit VNNI (a8_vnni256.h), bit-identical to the AVX2 ones: AVX-VNNI
    # (GCC >= 11), and the same code in its AVX-512 VL form for CPUs that have that instead.
    (
        "AVX-VNNI 8-bit activations",
        "kernels_avxvnni.cpp",
        AVX2_FLAGS + ["-mavxvnni"],
        "SPECDEC_HAVE_AVXVNNI",
    ),
    (
        "AVX2 tables' VNNI (EVEX)",
        "kernels_avx2_vnni_evex.cpp",
        AVX2_FLAGS + ["-mavx512f", "-mavx512vl", "-mavx512vnni"],
        "SPECDEC_HAVE_VNNI256EVEX",
    ),
]


def _warn(msg: str) -> None:
    print(f"WARNING (specdec): {msg}", file=sys.stderr)


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def _static_libstdcxx(linker: str) -> bool:
    """True when ``linker`` (a g++ driver) has no shared libstdc++ to link: the extension would
    then carry a private static copy whose locale is never set up, and the first error message a
    kernel formats (any TORCH_CHECK) crashes the process (seen with a /opt/gcc toolchain)."""
    try:
        out = subprocess.run(
            [linker, "-print-file-name=libstdc++.so"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False  # not a g++ driver we can ask: nothing known
    return os.sep not in out


def _native_build():
    """Return (ext_modules, cmdclass) for the extension, or ([], {}) when it cannot be built."""
    if os.environ.get("SPECDEC_NO_EXTENSION", "") not in ("", "0"):
        _warn("SPECDEC_NO_EXTENSION is set: not building the native kernels")
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # torch missing from the build environment
        _warn(f"torch C++ extension support unavailable ({exc}); installing without native kernels")
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        """BuildExtension that compiles the ISA units separately and never fails the install."""

        def build_extensions(self) -> None:
            linker = (getattr(self.compiler, "linker_so", None) or ["c++"])[0]
            if _static_libstdcxx(linker):
                _warn(
                    f"{linker} finds no shared libstdc++ (only a static one): the extension's "
                    "error messages would crash the process; set CC, CXX and LDSHARED to a "
                    "compiler with libstdc++.so (e.g. CXX=/usr/bin/g++ LDSHARED='/usr/bin/g++ "
                    "-shared')"
                )
            for ext in self.extensions:
                if ext.name == KERNELS_EXT:
                    self._add_isa_objects(ext)
            try:
                super().build_extensions()
            except Exception:
                _warn(
                    "native kernels failed to build; installing without them\n"
                    + traceback.format_exc()
                )

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception:
                _warn(
                    f"building {ext.name} failed; installing without it\n" + traceback.format_exc()
                )

        def _add_isa_objects(self, ext) -> None:
            if not _is_x86():
                return
            # Each unit is compiled with the defines of the units before it. They are compiled
            # at once (one thread each: the compiler runs as its own process), assuming every one
            # succeeds; a unit that fails is dropped with every unit after it, as a sequential
            # build would, since those were compiled with its define.
            env_jobs = os.environ.get("MAX_JOBS", "")  # as torch reads it: digits, else ignored
            jobs = int(env_jobs) if env_jobs.isdigit() else (os.cpu_count() or 1)
            jobs = max(1, min(len(ISA_UNITS), jobs))

            def compile_unit(index: int) -> list[str]:
                _, source, flags, _ = ISA_UNITS[index]
                defines = [unit[3] for unit in ISA_UNITS[:index]]
                # Plain distutils compiler (BuildExtension has not wrapped it yet): per-file flags.
                return self.compiler.compile(
                    [os.path.join(CSRC, source)],
                    output_dir=self.build_temp,
                    include_dirs=[CSRC],
                    extra_postargs=flags + [f"-D{d}" for d in defines],
                )

            with ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = [pool.submit(compile_unit, i) for i in range(len(ISA_UNITS))]
            defines: list[str] = []
            for (label, _, _, define), future in zip(ISA_UNITS, futures):
                try:
                    objects = future.result()
                except Exception:
                    _warn(
                        f"{label} kernels failed to compile; building without them\n"
                        + traceback.format_exc()
                    )
                    break
                defines.append(define)
                ext.extra_objects = list(ext.extra_objects or []) + list(objects)
            ext.extra_compile_args = list(ext.extra_compile_args or []) + [
                f"-D{d}" for d in defines
            ]

    ext = CppExtension(
        name=KERNELS_EXT,
        sources=[
            os.path.join(CSRC, f)
            for f in (
                "ops.cpp",
                "layer.cpp",
                "moe.cpp",
                "allreduce.cpp",
                "head.cpp",
                "kernels_portable.cpp",
                "kquants.cpp",
            )
        ],
        include_dirs=[os.path.abspath(CSRC)],
        extra_compile_args=list(COMMON_FLAGS),
    )
    ext.depends = [
        os.path.join(CSRC, f)
        for f in (
            "a8_vnni256.h",
            "kq_vnni256.h",
            "allreduce.h",
            "amx_tiles.h",
            "attn_common.h",
            "avx2_tiles.h",
            "half.h",
            "head_chunks.h",
            "kernels.h",
            "linear_spec.h",
            "moe.h",
            "ops.h",
            "parallel.h",
            "prefetch.h",
            "simd512.h",
            "tile_store.h",
        )
    ] + [os.path.join(CSRC, unit[1]) for unit in ISA_UNITS]
    suffix = CppExtension(
        name="specdec.spec_decode._suffix_native",
        sources=[os.path.join(SUFFIX_CSRC, "suffix_tree.cpp")],
        extra_compile_args=["-O3", "-g0", "-std=c++17", "-fvisibility=hidden"],
    )
    suffix.libraries = []  # pybind11 only (headers from torch): no torch library to load
    spm = CppExtension(
        name="specdec.model._spm_native",
        sources=[os.path.join(SPM_CSRC, "spm_bpe.cpp")],
        extra_compile_args=["-O3", "-g0", "-std=c++17", "-fvisibility=hidden"],
    )
    spm.libraries = []  # pybind11 only, as the suffix trees
    return [ext, suffix, spm], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _native_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
