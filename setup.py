"""Build of the optional native kernel extension ``specdec.kernels._C``.

Project metadata lives in pyproject.toml; this file only adds the C++ extension:

* ``specdec/kernels/csrc/ops.cpp`` (torch binding) and ``kernels_portable.cpp`` are compiled with
  the flags torch's ``BuildExtension`` uses (no ISA flags), so the module imports on any x86-64 CPU;
* ``kernels_avx2.cpp`` is compiled on its own with ``-mavx2 -mfma -mf16c -O3`` and linked in; the
  binding only calls it after ``__builtin_cpu_supports`` says the CPU has those instructions.

The extension is optional: when torch's build helpers are missing or any compile step fails, the
build prints a warning and the package installs without it (``specdec.kernels`` then falls back to
its pure-torch implementation).  Set ``SPECDEC_NO_EXTENSION=1`` to skip the build on purpose.
"""

from __future__ import annotations

import os
import platform
import sys
import traceback

from setuptools import setup

CSRC = os.path.join("specdec", "kernels", "csrc")
COMMON_FLAGS = ["-O3", "-g0", "-ffp-contract=off"]
AVX2_FLAGS = ["-O3", "-g0", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-std=c++17"]


def _warn(msg: str) -> None:
    print(f"WARNING (specdec): {msg}", file=sys.stderr)


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


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
        """BuildExtension that compiles the AVX2 unit separately and never fails the install."""

        def build_extensions(self) -> None:
            for ext in self.extensions:
                self._add_avx2_object(ext)
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

        def _add_avx2_object(self, ext) -> None:
            sources = getattr(ext, "avx2_sources", None)
            if not sources:
                return
            if not _is_x86():
                return
            try:
                # Plain distutils compiler (BuildExtension has not wrapped it yet): per-file flags.
                objects = self.compiler.compile(
                    sources,
                    output_dir=self.build_temp,
                    include_dirs=[CSRC],
                    extra_postargs=AVX2_FLAGS,
                )
            except Exception:
                _warn(
                    "AVX2 kernels failed to compile; building the portable kernels only\n"
                    + traceback.format_exc()
                )
                return
            ext.extra_objects = list(ext.extra_objects or []) + list(objects)
            ext.extra_compile_args = list(ext.extra_compile_args or []) + ["-DSPECDEC_HAVE_AVX2"]

    ext = CppExtension(
        name="specdec.kernels._C",
        sources=[os.path.join(CSRC, "ops.cpp"), os.path.join(CSRC, "kernels_portable.cpp")],
        include_dirs=[os.path.abspath(CSRC)],
        extra_compile_args=list(COMMON_FLAGS),
    )
    ext.avx2_sources = [os.path.join(CSRC, "kernels_avx2.cpp")]
    ext.depends = [os.path.join(CSRC, h) for h in ("kernels.h", "parallel.h")] + ext.avx2_sources
    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _native_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
