"""The 8-bit activation kernels on AMX-INT8 tiles against the VNNI ones and the scalar twin.

The same integer block sums and the same float steps, so every path gives the same bits.  The
paths are those this CPU and build have ("amx" needs AMX-INT8 and the kernel's tile permission,
"vnni" AVX-512 VNNI in its groups walk, "vnni-stationary" in its weight-stationary walk, "portable"
always runs); on a machine without AMX the tests run over the others.  The AMX path is forced
from one row on (its default thresholds send few-row calls to VNNI), so that every row count goes
through the tiles.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from specdec import kernels as K
from tests.fixtures.kernels import QUANT, _a8_weight, _randn, _require_native

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33)


def _paths() -> list[str]:
    paths = ["portable"]
    if K.native_available() and K._C.a8_available():
        # the VNNI kernels' two walks of a product (kernels.h A8Walk): the same bits, each chosen
        # by the CPU's vendor, so both run here whatever this CPU picks
        paths[:0] = ["vnni", "vnni-stationary"]
        if K.amx_available():
            paths.insert(0, "amx")
    elif K.native_available() and K._C.has_avx2_build() and "avx2" in _avx2_a8():
        paths.insert(0, "avx2")
    return paths


def _avx2_a8() -> str:
    """The 8-bit activation kernels the AVX2 table picks here ("portable" when not built)."""
    try:
        K.set_native_isa("avx2")
        return K.a8_kernels() or "portable"
    except Exception:  # noqa: BLE001 - no AVX2 on this CPU
        return "portable"
    finally:
        K.set_native_isa("auto")


@contextlib.contextmanager
def _path(path: str) -> Iterator[None]:
    """Run the 8-bit activation kernels through one path (process-wide, restored after)."""
    _require_native()
    if path in ("portable", "avx2"):
        K.set_native_isa(path)
    else:
        K.set_native_isa("avx512")
        K.set_native_amx(path == "amx")
        if path == "amx":
            K._C.set_amx_min_rows(1)
        K._C.set_a8_walk("stationary" if path == "vnni-stationary" else "groups")
    try:
        expected = {"amx": "amx-int8", "vnni": "avx512vnni", "vnni-stationary": "avx512vnni"}
        expected = {**expected, "avx2": "avx2", "portable": "portable"}[path]
        assert K.a8_kernels() == expected
        yield
    finally:
        if hasattr(K._C, "set_a8_walk"):
            K._C.set_a8_walk("auto")
        if K.amx_available():
            # NOTE: the setter lives in the AMX unit, built for AMX/AVX-512 CPUs: on an AVX2
            # CPU (AMD EPYC here) even that one line is an illegal instruction
            K._C.set_amx_min_rows(0)
        K.set_native_amx(True)
        K.set_native_isa("auto")


def _linear(
    path: str, x: torch.Tensor, w: K.PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    with _path(path):
        return K.get_ops("native").linear(x, w, bias)


@pytest.mark.parametrize("qtype", QUANT)
@pytest.mark.parametrize("k", [32, 96, 576])
def test_paths_agree_bit_for_bit(qtype, k):
    # 80 outputs = 5 groups of 16: passes of three, two and one groups.  Bias or not, one and
    # two threads (the pool's workers load their own tile configuration).
    w = _a8_weight(qtype, 80, k, seed=7)
    bias = _randn(80, seed=8)
    x = _randn(max(ROWS), k, seed=9) * 3
    x[1, :32] = 0.0  # an all-zero block (scale 0)
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in ROWS:
                for b in (None, bias):
                    ref = _linear("portable", x[:m], w, b)
                    for path in _paths():
                        y = _linear(path, x[:m], w, b)
                        assert torch.equal(y, ref), (path, qtype, k, m, threads, b is not None)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("qtype", QUANT)
def test_rows_batch_invariant(path, qtype):
    # Every row of a batch equals that row alone, at every offset (row tiles of 16: 17 rows run
    # as 9 + 8, 33 as 11 x 3).
    w = _a8_weight(qtype, 48, 96, seed=3)
    bias = _randn(48, seed=4)
    x = _randn(40, 96, seed=5)
    with _path(path):
        ops = K.get_ops("native")
        single = torch.cat([ops.linear(x[i : i + 1], w, bias) for i in range(40)])
        for m in ROWS:
            for off in {0, 40 - m, (40 - m) // 2}:
                assert torch.equal(ops.linear(x[off : off + m], w, bias), single[off : off + m])


def test_default_thresholds_and_many_groups():
    # The default per-format thresholds (AMX for many rows, VNNI below) change no bit, and a
    # product large enough to split over the thread pool agrees with the scalar twin.
    _require_native()
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for qtype in QUANT:
            w = _a8_weight(qtype, 1024, 576, seed=11)
            x = _randn(20, 576, seed=12)
            ref = _linear("portable", x, w, None)
            for m in (1, 8, 12, 14, 16, 20):
                assert torch.equal(K.get_ops("native").linear(x[:m], w, None), ref[:m]), (qtype, m)
    finally:
        torch.set_num_threads(prev)


def _child_linear(conn, x: torch.Tensor, w: K.PackedWeight) -> None:
    try:
        conn.send(K.get_ops("native").linear(x, w, None).numpy())  # plain pickling
    finally:
        conn.close()


@pytest.mark.parametrize("path", _paths())
def test_forked_child_computes_the_same(path):
    # A forked child asks for the tile permission again (or inherits it) and configures its own
    # tiles: the same result as the parent.
    w = _a8_weight("q8_0", 64, 96, seed=13)
    x = _randn(16, 96, seed=14)
    with _path(path):
        y = K.get_ops("native").linear(x, w, None)
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_linear, args=(child, x, w))
        proc.start()
        got = parent.recv()
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert torch.equal(torch.from_numpy(got), y)


def test_env_turns_amx_off():
    _require_native()
    code = (
        "from specdec import kernels as K; "
        "print(K.a8_kernels(), K._C.amx_enabled(), K.amx_available() == bool(K._C.amx_available()))"
    )
    env = dict(os.environ, SPECDEC_AMX="0")
    env.pop("SPECDEC_KERNELS_ISA", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] != "amx-int8" and out[1] == "False" and out[2] == "True"
    if K.amx_available() and K.native_isa() == "avx512" and K._C.amx_enabled():
        assert K.a8_kernels() == "amx-int8"


def test_walk_named_by_the_environment_and_checked():
    # SPECDEC_A8_WALK picks the VNNI kernels' walk from the start (what benchmarks compare);
    # set_a8_walk refuses a name it does not know; the bench reports record the walk in use.
    _require_native()
    code = "import specdec.kernels as K; print(K.a8_walk())"
    for walk in ("groups", "stationary"):
        env = {**os.environ, "SPECDEC_A8_WALK": walk}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.stdout.strip() == walk, out.stderr[-500:]
    with pytest.raises(ValueError, match="'auto', 'groups' or 'stationary'"):
        K._C.set_a8_walk("fast")
    from specdec.bench.report import collect_environment

    assert collect_environment("m", "p", {})["a8_walk"] == K.a8_walk()
