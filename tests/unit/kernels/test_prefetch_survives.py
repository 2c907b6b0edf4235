"""The kernels' prefetch helpers (csrc/prefetch.h) survive the optimiser.

GCC 12 at -O3 deleted loops that only called a one-line ``_mm_prefetch`` wrapper (it found the
wrapper free of side effects), so the attention kernels' prefetch loops compiled to a bare return.
This builds a loop of each helper, as the kernels call them, with the flags setup.py uses for the
kernel units, and counts the prefetch instructions left in it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[3] / "specdec" / "kernels" / "csrc"

SOURCE = r"""
#include <stdint.h>
#include "prefetch.h"
namespace specdec {
namespace {
// the shape that was deleted: an inline function of an unrolled loop, then a tail loop, of
// nothing but the helper, called from a kernel
inline void span(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    int64_t o = 0;
    for (; o + 256 <= bytes; o += 256) {
        HELPER(c + o);
        HELPER(c + o + 64);
        HELPER(c + o + 128);
        HELPER(c + o + 192);
    }
    for (; o < bytes; o += 64) HELPER(c + o);
}
}  // namespace
void kernel(const uint8_t* p, int64_t bytes) { span(p, bytes); }
}  // namespace specdec
"""


@pytest.mark.parametrize("helper,insn", [("prefetch", "prefetcht0"), ("prefetch_l2", "prefetcht1")])
def test_a_loop_of_the_helper_keeps_its_prefetches(tmp_path: Path, helper: str, insn: str) -> None:
    src = tmp_path / "span.cpp"
    src.write_text(SOURCE.replace("HELPER", helper))
    obj = tmp_path / "span.o"
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-std=c++17"]
    subprocess.run(["g++", *flags, f"-I{CSRC}", "-c", str(src), "-o", str(obj)], check=True)
    dis = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(obj)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = re.findall(rf"\b{insn}\b", dis)
    # the unrolled body's four and the tail's one
    assert len(found) >= 5, dis
