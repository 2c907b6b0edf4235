"""The native shared-memory all-reduce of tensor-parallel ranks (kernels/csrc/allreduce.cpp):
sums in rank order, bit for bit, round after round, in chunks past a slot, and a peer that
never comes ends in a one-line error, not a hang."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specdec.kernels import native_module

_C = native_module()
pytestmark = pytest.mark.skipif(_C is None, reason="native kernels not built")


def _group(size: int, cap: int, watch=lambda: None, timeout: float = 30.0) -> list:
    flags = torch.zeros(size, 8, dtype=torch.int64)
    data = torch.zeros(2, size, cap, dtype=torch.float32)
    return [_C.ShmReducer(flags, data, r, size, watch, timeout) for r in range(size)]


def _run(reducers: list, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    out: list = [None] * len(reducers)

    def rank(r: int) -> None:
        out[r] = reducers[r].reduce(inputs[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(reducers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize(("size", "shape"), [(2, (3, 7)), (3, (5, 11)), (4, (2, 40)), (2, (0, 4))])
def test_every_rank_gets_the_rank_order_sum_bit_for_bit(size, shape) -> None:
    reducers = _group(size, cap=16)  # NOTE: most shapes take several rounds of 16 floats
    g = torch.Generator().manual_seed(size)
    for _ in range(5):  # rounds alternate between the two buffers
        xs = [torch.randn(shape, generator=g) * 10 ** torch.randint(-3, 4, (1,)).item()
              for _ in range(size)]  # fmt: skip
        want = xs[0].clone()
        for x in xs[1:]:
            want += x
        for got in _run(reducers, xs):
            assert got.shape == want.shape
            assert torch.equal(got, want)


def test_a_peer_that_never_comes_times_out_in_one_line() -> None:
    (r0, _r1) = _group(2, cap=8, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^tensor-parallel all-reduce failed: a rank stopped"):
        r0.reduce(torch.ones(4))
    assert time.monotonic() - start < 10


def test_the_watch_reason_ends_the_wait_early() -> None:
    (r0, _r1) = _group(2, cap=8, watch=lambda: "tensor-parallel rank 1 (pid 7) exited (-9)")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"all-reduce failed: tensor-parallel rank 1 \(pid 7\)"):
        r0.reduce(torch.ones(4))
    assert time.monotonic() - start < 10  # not the 30 s timeout


def test_bad_buffers_are_refused() -> None:
    flags = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="data must be contiguous float32"):
        _C.ShmReducer(flags, torch.zeros(2, 3, 8), 0, 2, None, 1.0)
    with pytest.raises(RuntimeError, match="rank out of range"):
        _C.ShmReducer(flags, torch.zeros(2, 2, 8), 2, 2, None, 1.0)
