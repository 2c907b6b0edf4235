"""Flash-decoding attention (kernels.h, AttnRows): accuracy against float64 across key blocks, and
a row's result bit-identical alone, among N rows, in other batch mixes and on 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch

from specdec.kernels import _C
from specdec.kv_cache.pool import blocked_keys
from tests.fixtures.attention import BLOCK, _isas

pytestmark = pytest.mark.skipif(_C is None, reason="native kernels not built")


def _cache(
    hkv: int, length: int, d: int, half: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [Hkv, L, D] and values [Hkv, L, D], float16 when `half`."""
    gen = torch.Generator().manual_seed(seed)
    k = 2 * torch.randn(hkv, length, d, generator=gen)
    v = torch.randn(hkv, length, d, generator=gen)
    return (k.half(), v.half()) if half else (k, v)


def _reference(q, k, v, start, scale, window=0, softcap=0.0) -> torch.Tensor:
    """Float64 attention of q's rows at positions start, start + 1, ... over k / v [Hkv, L, D]."""
    q, k, v = q.double(), k.double(), v.double()
    t_rows, h, d = q.shape
    g = h // k.shape[0]
    out = torch.zeros(t_rows, h, d, dtype=torch.float64)
    for t in range(t_rows):
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0
        for hh in range(h):
            s = (k[hh // g, lo : pos + 1] @ q[t, hh]) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            out[t, hh] = torch.softmax(s, 0) @ v[hh // g, lo : pos + 1]
    return out


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(
    "h,hkv,d,window,softcap",
    [
        (9, 3, 64, 0, 0.0),
        (4, 4, 72, 0, 0.0),
        (6, 2, 64, 200, 0.0),
        (4, 1, 20, 0, 30.0),
        (16, 2, 128, 0, 0.0),
    ],
)
def test_accuracy_across_blocks(isa, half, h, hkv, d, window, softcap) -> None:
    length, start, rows = 700, 650, 12  # three blocks of 256 keys, the last partly filled
    k, v = _cache(hkv, length, d, half, seed=1)
    q = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(2))
    got = _C.attention(q, blocked_keys(k, 16), v, start, d**-0.5, window, softcap)
    want = _reference(q, k, v, start, d**-0.5, window, softcap)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half", [False, True])
def test_row_alone_equals_row_among_n(isa, half) -> None:
    h, hkv, d, length = 9, 3, 64, 2 * BLOCK + 80
    k, v = _cache(hkv, length, d, half, seed=3)
    kt = blocked_keys(k, 16)
    q = torch.randn(40, h, d, generator=torch.Generator().manual_seed(4))
    start = 2 * BLOCK - 10  # the rows straddle a block boundary
    alone = torch.cat([_C.attention(q[t : t + 1], kt, v, start + t, 0.125) for t in range(40)])
    for n in (2, 5, 8, 16, 17, 33, 40):
        for off in sorted({0, 3, 40 - n}):
            if off + n > 40:
                continue
            got = _C.attention(q[off : off + n], kt, v, start + off, 0.125)
            assert torch.equal(got, alone[off : off + n]), (n, off)
    # A prefill of the whole cache: every row equals its own decode step.
    rows = length
    qp = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(5))
    full = _C.attention(qp, kt, v, 0, 0.125, 48, 0.0)
    for t in (0, 15, 16, 127, 128, 200, rows - 1):
        assert torch.equal(full[t : t + 1], _C.attention(qp[t : t + 1], kt, v, t, 0.125, 48, 0.0))


@pytest.mark.parametrize("h,hkv", [(9, 3), (8, 4)])
def test_thread_count_changes_nothing(h, hkv) -> None:
    """3 kv heads: blocks spread over threads either way; 4: whole units per task on one thread,
    single blocks on two (ops.cpp attention_seqs picks by units per thread)."""
    d, length = 64, 3000  # 12 blocks a kv head
    k, v = _cache(hkv, length, d, True, seed=6)
    kt = blocked_keys(k, 16)
    q = torch.randn(8, h, d, generator=torch.Generator().manual_seed(7))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [_C.attention(q[:n], kt, v, length - 8, 0.125) for n in (1, 8)]
        torch.set_num_threads(2)
        two = [_C.attention(q[:n], kt, v, length - 8, 0.125) for n in (1, 8)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("half", [False, True])
def test_short_context_rows_split_over_threads(isa, half) -> None:
    """A verification step at a short context (one key block, 3 kv heads: 3 items for 2 threads)
    splits its rows into smaller units (ops.cpp attention_seqs); every row equals itself alone, on
    1 and on 2 threads, for every row count."""
    h, hkv, d, length = 9, 3, 64, 220
    k, v = _cache(hkv, length, d, half, seed=8)
    kt = blocked_keys(k, 16)
    q = torch.randn(17, h, d, generator=torch.Generator().manual_seed(9))
    start = 200
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            alone = torch.cat(
                [_C.attention(q[t : t + 1], kt, v, start + t, 0.125) for t in range(17)]
            )
            for n in (2, 3, 4, 5, 7, 8, 16, 17):
                got = _C.attention(q[:n], kt, v, start, 0.125)
                assert torch.equal(got, alone[:n]), (threads, n)
    finally:
        torch.set_num_threads(before)


def test_batch_mixes(isa) -> None:
    """Sequences of other lengths and row counts in the same call change no row."""
    h, hkv, d, length, slots = 6, 2, 64, 600, 3
    gen = torch.Generator().manual_seed(8)
    k = (2 * torch.randn(slots, hkv, length, d, generator=gen)).half()
    v = torch.randn(slots, hkv, length, d, generator=gen).half()
    kt = blocked_keys(k, 16)
    seqs = [(0, 590, 9), (2, 130, 1), (1, 0, 40)]  # (slot, start, rows): verify, decode, prefill
    q = torch.randn(sum(n for _, _, n in seqs), h, d, generator=gen)
    mixed = _C.attention_seqs(q, kt, v, *map(list, zip(*seqs)), 0.125)
    offset = 0
    for slot, start, n in seqs:
        alone = _C.attention_seqs(q[offset : offset + n], kt, v, [slot], [start], [n], 0.125)
        assert torch.equal(mixed[offset : offset + n], alone), slot
        for t in (0, n - 1):
            row = q[offset + t : offset + t + 1]
            single = _C.attention_seqs(row, kt, v, [slot], [start + t], [1], 0.125)
            assert torch.equal(mixed[offset + t : offset + t + 1], single), (slot, t)
        offset += n
    # Two sequences in reverse order give the same rows.
    swapped = _C.attention_seqs(
        torch.cat([q[9:10], q[:9]]), kt, v, [2, 0], [130, 590], [1, 9], 0.125
    )
    assert torch.equal(swapped[1:], mixed[:9]) and torch.equal(swapped[:1], mixed[9:10])


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 72), (4, 1, 20), (16, 2, 128), (6, 2, 19)])
def test_vector_isas_agree_bit_for_bit(half, h, hkv, d) -> None:
    """The AVX-512 attention runs the AVX2 kernel's operations on 16 lanes: the same bits for any
    row count, head size (a partial vector where d % 16 != 0, a partial step of the four chains where
    d % 4 != 0), window and soft cap."""
    vector = [isa for isa in _isas() if isa != "portable"]
    length = 3 * BLOCK + 40
    k, v = _cache(hkv, length, d, half, seed=9)
    kt = blocked_keys(k, 16)
    q = torch.randn(17, h, d, generator=torch.Generator().manual_seed(10))
    before = _C.isa()
    runs: dict[str, list[torch.Tensor]] = {}
    try:
        for isa in vector:
            _C.set_isa(isa)
            runs[isa] = [
                _C.attention(q[:n], kt, v, length - n, 0.125, window, softcap)
                for n in (1, 3, 8, 17)
                for window, softcap in ((0, 0.0), (300, 0.0), (0, 30.0))
            ]
    finally:
        _C.set_isa(before)
    for isa in vector[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[isa], runs[vector[0]])), isa
