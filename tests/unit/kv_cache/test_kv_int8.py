"""The 8-bit KV cache (kv_cache_dtype int8): its blocks, the native attention over them (accuracy,
batch invariance, ISAs), the native layers writing the bytes KVCache.store writes, and the engine
end to end (speculation exact, prefix caching, the KV budget, errors)."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import ConfigError
from specdec.kernels import _C
from specdec.kv_cache.pool import KVCache, quantize_q8
from specdec.model.loader import load_checkpoint
from tests.fixtures.attention import BLOCK, _isas

pytestmark = pytest.mark.skipif(_C is None, reason="native kernels not built")

CPU = torch.device("cpu")


def _filled(hkv: int, length: int, d: int, seed: int, slots: int = 1) -> KVCache:
    """An int8 cache of one layer whose slots hold random keys (x2) and values at 0..length-1."""
    gen = torch.Generator().manual_seed(seed)
    kv = KVCache(1, slots, hkv, length, d, torch.int8, CPU, key_block=16)
    for slot in range(slots):
        k = 2 * torch.randn(length, hkv, d, generator=gen)
        kv.store(0, slot, 0, k, torch.randn(length, hkv, d, generator=gen))
    return kv


def _parts(kv: KVCache, slot: int, keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales [Hkv, L] and entries [Hkv, L, D] (as floats) of one slot's keys or values."""
    t = kv.k[0, slot] if keys else kv.v[0, slot]
    scales, entries = kv._q8_parts(t, keys)
    if keys:
        entries = entries.transpose(-1, -2)
    hkv = t.shape[0]
    return scales.reshape(hkv, -1), entries.reshape(hkv, -1, kv.head_dim).double()


def _rows(shape, hkv: int, start: int, window: int):
    """(row, head, its kv head, first key, last key) of every query of q [rows, H, D]."""
    rows, h, _ = shape
    for t in range(rows):
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0
        for hh in range(h):
            yield t, hh, hh // (h // hkv), lo, pos


def _reference(q, kv: KVCache, slot, start, scale, window=0, softcap=0.0) -> torch.Tensor:
    """Float64 attention with the int8 cache's definition: score = q . k_int8 * (k_scale * scale)
    and each softmax weight times its value row's scale, over the int8 values."""
    ks, ke = _parts(kv, slot, keys=True)
    vs, ve = _parts(kv, slot, keys=False)
    q = q.double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, hh, kh, lo, pos in _rows(q.shape, ke.shape[0], start, window):
        s = (ke[kh, lo : pos + 1] @ q[t, hh]) * (ks[kh, lo : pos + 1].double() * scale)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        p = torch.exp(s - s.max())
        out[t, hh] = ((p * vs[kh, lo : pos + 1].double()) @ ve[kh, lo : pos + 1]) / p.sum()
    return out


def _integer_reference(q, kv: KVCache, slot, start, scale, window=0, softcap=0.0) -> torch.Tensor:
    """The integer attention's definition (kernels.h): each query as int8 (largest magnitude ->
    127, half to even), exact integer scores times (key scale * scale * query scale); per block of
    BLOCK keys a float softmax, each weight times its value scale as x = w * 255 / largest written
    as two bytes (floor(x), round((x - floor(x)) * 255)), exact integer value sums of each, joined
    and times largest / 255; the blocks merged as flash-decoding does."""
    ks, ke = _parts(kv, slot, keys=True)
    vs, ve = _parts(kv, slot, keys=False)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, hh, kh, lo, pos in _rows(q.shape, ke.shape[0], start, window):
        x = q[t, hh].float()
        amax = x.abs().max()
        q8 = torch.round(x * (127.0 / amax)).clamp(-127, 127).double()
        ms, ls, os_ = [], [], []
        for b0 in range(lo // BLOCK * BLOCK, pos + 1, BLOCK):
            j0, j1 = max(lo, b0), min(pos + 1, b0 + BLOCK)
            s = (ke[kh, j0:j1] @ q8) * (ks[kh, j0:j1].double() * scale * float(amax / 127.0))
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            m = s.max()
            p = torch.exp(s - m)
            pv = (p * vs[kh, j0:j1].double()).float()
            x = pv * (255.0 / pv.max())
            hi = torch.floor(x)
            low = torch.round((x - hi) * 255.0)
            ve_b = ve[kh, j0:j1]
            ms.append(m)
            ls.append(p.sum())
            os_.append((hi.double() @ ve_b + (low.double() @ ve_b) / 255) * float(pv.max() / 255))
        top = max(ms)
        w = [torch.exp(m - top) for m in ms]
        out[t, hh] = sum(wi * o for wi, o in zip(w, os_)) / sum(wi * li for wi, li in zip(w, ls))
    return out


def _integer(isa_name: str) -> bool:
    """Whether the kernels of ``isa_name`` read an int8 cache with integer products."""
    before = _C.isa()
    try:
        _C.set_isa(isa_name)
        return _C.int8_attention()
    finally:
        _C.set_isa(before)


def test_quantize_rounds_half_to_even_per_row() -> None:
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0], [0.0] * 5, [254.0, 1.0, 3.0, -1.0, 0.0]])
    scale, q = quantize_q8(x)
    assert scale.tolist() == [1.0, 0.0, 2.0]
    assert q.tolist() == [[127, 0, 2, -2, -127], [0] * 5, [127, 0, 2, 0, 0]]


@pytest.mark.parametrize("start", [0, 13])
def test_store_holds_each_entry_within_half_its_scale(start: int) -> None:
    kv = KVCache(2, 3, 2, 70, 8, torch.int8, CPU, key_block=16)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 40, 2, 8, generator=gen)
    kv.store(1, 2, start, k, v)
    for got, want in ((kv.keys(1, 2), k), (kv.values(1, 2), v)):
        got = got[:, start : start + 40].transpose(0, 1)  # [n, Hkv, D]
        half_step = want.abs().amax(-1, keepdim=True) / 254
        assert ((got - want).abs() <= half_step * (1 + 1e-6)).all()
    assert kv.keys(1, 2)[:, :start].abs().sum() == 0  # nothing written before start
    assert kv.k.dtype == kv.v.dtype == torch.int8
    assert kv.k.shape == kv.v.shape == (2, 3, 2, 5, 16 * (4 + 8))


def test_an_int8_cache_takes_about_half_a_half_caches_bytes() -> None:
    f16 = KVCache.bytes_per_token(30, 3, 64, torch.float16)
    q8 = KVCache.bytes_per_token(30, 3, 64, torch.int8)
    assert q8 == 2 * 30 * 3 * (64 + 4) and q8 / f16 == pytest.approx(68 / 128)
    kv = KVCache(30, 1, 3, 64, 64, torch.int8, CPU, key_block=16)
    assert kv.reserved_bytes == 64 * q8


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize(
    "h,hkv,d,window,softcap",
    [(9, 3, 64, 0, 0.0), (4, 4, 72, 0, 0.0), (6, 2, 64, 200, 0.0), (4, 1, 20, 0, 30.0)],
)
def test_accuracy_across_blocks(h, hkv, d, window, softcap) -> None:
    length, start, rows = 700, 650, 12  # three blocks of 256 keys, the last partly filled
    kv = _filled(hkv, length, d, seed=1)
    q = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(2))
    integer = _C.int8_attention()
    for n in (1, rows):  # values read in place (one row) and widened (several)
        got = _C.attention(q[:n], kv.k[0, 0], kv.v[0, 0], start, d**-0.5, window, softcap)
        exact = _reference(q[:n], kv, 0, start, d**-0.5, window, softcap)
        if integer:
            # its own definition to rounding (a weight byte may round the other way where the
            # float reference's exp differs in the last bit), and within 3% of the float products
            want = _integer_reference(q[:n], kv, 0, start, d**-0.5, window, softcap)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)
            assert (got.double() - exact).norm() < 0.03 * exact.norm()
        else:
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(_C is None or not _C.cpu_features().get("avx512vnni"), reason="no VNNI")
def test_integer_products_where_the_cpu_has_them() -> None:
    """On AVX-512 VNNI + VBMI the 8-bit cache is read with integer products; the switch works and
    changes the result (they are not the float products); the AVX2 table keeps float ones."""
    if not _C.has_avx512_build():
        pytest.skip("built without AVX-512")
    assert _integer("avx512") == _C.cpu_features().get("avx512vbmi", True)
    assert not _integer("avx2") and not _integer("portable")
    if not _integer("avx512"):
        return
    kv = _filled(3, 400, 64, seed=11)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(12))
    before = _C.isa()
    try:
        _C.set_isa("avx512")
        on = _C.attention(q, kv.k[0, 0], kv.v[0, 0], 397, 0.125)
        _C.set_int8_attention(False)
        assert not _C.int8_attention()
        off = _C.attention(q, kv.k[0, 0], kv.v[0, 0], 397, 0.125)
    finally:
        _C.set_int8_attention(True)
        _C.set_isa(before)
    assert not torch.equal(on, off)
    torch.testing.assert_close(on, off, rtol=0, atol=0.05)


def test_integer_sums_on_the_tile_unit_are_the_vnni_ones_bit_for_bit() -> None:
    """With AMX the integer attention's score and value sums of 8 or more queries run on the
    tile unit: the same exact sums, so the same bits as the VNNI kernel, and a row alone (3
    queries, on VNNI) equals that row inside a batch (on the tiles). Blocks of 256 keys, the last partly
    filled, and head sizes of one and two 64-byte chunks."""
    from specdec import kernels as K

    if not (K.amx_available() and _integer("avx512")):
        pytest.skip("needs AMX-INT8 and the integer attention (AVX-512 VNNI + VBMI)")
    before = _C.isa()
    try:
        _C.set_isa("avx512")
        for h, hkv, d in ((9, 3, 64), (4, 4, 72), (8, 1, 20)):
            kv = _filled(hkv, 700, d, seed=21 + d)
            q = torch.randn(16, h, d, generator=torch.Generator().manual_seed(d))
            start = 650
            K.set_native_amx(True)
            tiles = _C.attention(q, kv.k[0, 0], kv.v[0, 0], start, d**-0.5)
            alone = [
                _C.attention(q[r : r + 1], kv.k[0, 0], kv.v[0, 0], start + r, d**-0.5)
                for r in (0, 5, 15)
            ]
            K.set_native_amx(False)
            vnni = _C.attention(q, kv.k[0, 0], kv.v[0, 0], start, d**-0.5)
            assert torch.equal(tiles, vnni), (h, hkv, d)
            for r, one in zip((0, 5, 15), alone):
                assert torch.equal(one[0], tiles[r]), (h, hkv, d, r)
    finally:
        K.set_native_amx(True)
        _C.set_isa(before)


def test_close_to_attention_over_the_float_values() -> None:
    """The 8-bit entries cost accuracy, not meaning: the outputs' error is ~1% of their norm
    (1.2% measured with these keys and values; a float16 cache's: 0.04%)."""
    length, h, hkv, d = 600, 9, 3, 64
    gen = torch.Generator().manual_seed(3)
    k, v = (
        2 * torch.randn(length, hkv, d, generator=gen),
        torch.randn(length, hkv, d, generator=gen),
    )
    kv = KVCache(1, 1, hkv, length, d, torch.int8, CPU, key_block=16)
    kv.store(0, 0, 0, k, v)
    f32 = KVCache(1, 1, hkv, length, d, torch.float32, CPU, key_block=16)
    f32.store(0, 0, 0, k, v)
    q = torch.randn(4, h, d, generator=gen)
    got = _C.attention(q, kv.k[0, 0], kv.v[0, 0], length - 4, 0.125)
    want = _C.attention(q, f32.k[0, 0], f32.v[0, 0], length - 4, 0.125)
    assert (got - want).norm() < 0.02 * want.norm()


@pytest.mark.usefixtures("isa")
def test_a_key_shift_keeps_the_softmax_and_cuts_the_keys_rounding() -> None:
    """Keys whose few channels sit far from zero at every position (as rotated keys' slow
    channels do): stored less their mean, attention is the same up to rounding, and the 8-bit
    keys' rounding costs far less, since the offset no longer sets each position's scale."""
    length, h, hkv, d = 300, 6, 2, 64
    gen = torch.Generator().manual_seed(5)
    offset = torch.zeros(hkv, d)
    offset[:, [3, 17, 40, 41]] = torch.tensor([25.0, -30.0, 20.0, 35.0])
    k = torch.randn(length, hkv, d, generator=gen) + offset
    v = torch.randn(length, hkv, d, generator=gen)
    q = torch.randn(4, h, d, generator=gen)
    f32 = KVCache(1, 1, hkv, length, d, torch.float32, CPU, key_block=16)
    f32.store(0, 0, 0, k, v)
    want = _C.attention(q, f32.k[0, 0], f32.v[0, 0], length - 4, 0.125)
    errors = []
    for shift in (None, k.mean(0)[None]):
        kv = KVCache(1, 1, hkv, length, d, torch.int8, CPU, key_block=16, key_shift=shift)
        kv.store(0, 0, 0, k, v)
        got = _C.attention(q, kv.k[0, 0], kv.v[0, 0], length - 4, 0.125)
        errors.append(((got - want).norm() / want.norm()).item())
    plain, shifted = errors
    assert shifted < 0.5 * plain, errors
    assert shifted < 0.02, errors
    # what is stored is the shifted key
    assert (kv.keys(0, 0)[:, :length] - (k - k.mean(0)).transpose(0, 1)).abs().max() < 0.1


@pytest.mark.usefixtures("isa")
def test_a_key_scale_undone_on_the_queries_evens_the_channels() -> None:
    """Keys stored as key * scale and queries multiplied by 1 / scale: the same products, and
    where a few channels carry large queries against small keys the 8-bit rounding (of the
    queries, on CPUs with integer products, and of the keys) costs less."""
    length, h, hkv, d = 300, 6, 2, 64
    gen = torch.Generator().manual_seed(6)
    big = [5, 6, 50]
    k = torch.randn(length, hkv, d, generator=gen)
    k[..., big] *= 0.05
    v = torch.randn(length, hkv, d, generator=gen)
    q = 0.3 * torch.randn(4, h, d, generator=gen)
    q[..., big] *= 40.0
    f32 = KVCache(1, 1, hkv, length, d, torch.float32, CPU, key_block=16)
    f32.store(0, 0, 0, k, v)
    want = _C.attention(q, f32.k[0, 0], f32.v[0, 0], length - 4, 0.125)
    qmax = q.abs().view(4, hkv, h // hkv, d).amax((0, 2))
    scale = (qmax / k.abs().amax(0)).sqrt()[None]  # [1, Hkv, D]
    errors = []
    for key_scale in (None, scale):
        kv = KVCache(1, 1, hkv, length, d, torch.int8, CPU, key_block=16, key_scale=key_scale)
        kv.store(0, 0, 0, k, v)
        qs = q
        if key_scale is not None:
            qs = (q.view(4, hkv, -1, d) * kv.query_scale[0][:, None]).view(4, h, d)
        got = _C.attention(qs, kv.k[0, 0], kv.v[0, 0], length - 4, 0.125)
        errors.append(((got - want).norm() / want.norm()).item())
    plain, scaled = errors
    assert scaled < 0.6 * plain, errors


def test_a_key_transform_is_for_an_int8_cache_of_its_shape() -> None:
    with pytest.raises(ValueError, match="key_shift"):
        KVCache(1, 1, 2, 32, 8, torch.float16, CPU, key_block=16, key_shift=torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match="key_shift"):
        KVCache(1, 1, 2, 32, 8, torch.int8, CPU, key_block=16, key_shift=torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="key_scale"):
        KVCache(1, 1, 2, 32, 8, torch.int8, CPU, key_block=16, key_scale=torch.ones(2, 2, 8))


def test_the_model_measures_its_key_transform_once_and_alike(tiny_llama) -> None:
    """An int8 cache's model measures its key shift and scale as it loads, from seeded tokens:
    the same in every process; float caches take none."""
    a = LLM(str(tiny_llama), kernels="native", kv_cache_dtype="int8").engine.model
    b = LLM(str(tiny_llama), kernels="native", kv_cache_dtype="int8").engine.model
    cfg = a.cfg
    for got, other in ((a.key_shift, b.key_shift), (a.key_scale, b.key_scale)):
        assert got is not None and got.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        assert torch.isfinite(got).all() and torch.equal(got, other)
    assert a.key_shift.abs().sum() > 0 and (a.key_scale > 0).all()
    assert not torch.equal(a.key_scale, torch.ones_like(a.key_scale))
    kv = a.make_kv_cache(1, 32)
    assert torch.equal(kv.key_shift, a.key_shift) and torch.equal(kv.key_scale, a.key_scale)
    assert torch.equal(a.make_kv_cache(1, 32, num_layers=1).key_scale, a.key_scale[:1])
    half = LLM(str(tiny_llama), kernels="native", kv_cache_dtype="float16").engine.model
    assert half.key_shift is None and half.key_scale is None
    assert half.make_kv_cache(1, 32).key_shift is None


@pytest.mark.usefixtures("isa")
def test_row_alone_equals_row_among_n() -> None:
    h, hkv, d, length = 9, 3, 64, 2 * BLOCK + 80
    kv = _filled(hkv, length, d, seed=3)
    kt, vt = kv.k[0, 0], kv.v[0, 0]
    q = torch.randn(40, h, d, generator=torch.Generator().manual_seed(4))
    start = 2 * BLOCK - 10  # the rows straddle a block boundary
    alone = torch.cat([_C.attention(q[t : t + 1], kt, vt, start + t, 0.125) for t in range(40)])
    for n in (2, 3, 8, 16, 17, 40):
        for off in sorted({0, 3, 40 - n}):
            if off + n <= 40:
                got = _C.attention(q[off : off + n], kt, vt, start + off, 0.125)
                assert torch.equal(got, alone[off : off + n]), (n, off)
    qp = torch.randn(length, h, d, generator=torch.Generator().manual_seed(5))
    full = _C.attention(qp, kt, vt, 0, 0.125, 48, 0.0)  # a prefill with a sliding window
    for t in (0, 15, 16, 127, 128, 200, length - 1):
        assert torch.equal(full[t : t + 1], _C.attention(qp[t : t + 1], kt, vt, t, 0.125, 48, 0.0))


def test_isas_agree_and_threads_change_nothing() -> None:
    kv = _filled(3, 3000, 64, seed=6)
    q = torch.randn(8, 9, 64, generator=torch.Generator().manual_seed(7))
    before_isa, before_threads = _C.isa(), torch.get_num_threads()
    runs = {}
    try:
        for isa in _isas():
            _C.set_isa(isa)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                runs[isa, threads] = [
                    _C.attention(q[:n], kv.k[0, 0], kv.v[0, 0], 2992, 0.125) for n in (1, 8)
                ]
    finally:
        _C.set_isa(before_isa)
        torch.set_num_threads(before_threads)
    for isa in _isas():
        assert all(torch.equal(a, b) for a, b in zip(runs[isa, 1], runs[isa, 2])), isa
        for n, a, b in zip((1, 8), runs[isa, 1], runs["portable", 1]):
            if _integer(isa):  # integer products: their own definition, near the float ones
                want = _integer_reference(q[:n], kv, 0, 2992, 0.125).float()
                torch.testing.assert_close(a, want, rtol=0, atol=2e-4)
                assert (a - b).norm() < 0.03 * b.norm()
            else:  # other exp code: close, not equal
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the float products: the same operations, equal
    vector = [isa for isa in _isas() if isa != "portable" and not _integer(isa)]
    for isa in vector[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[isa, 1], runs[vector[0], 1])), isa


@pytest.mark.usefixtures("isa")
def test_batch_mixes() -> None:
    """Sequences of other lengths and row counts in the same call change no row."""
    kv = _filled(2, 600, 64, seed=8, slots=3)
    kt, vt = kv.k[0], kv.v[0]
    seqs = [(0, 590, 9), (2, 130, 1), (1, 0, 40)]  # (slot, start, rows): verify, decode, prefill
    q = torch.randn(50, 6, 64, generator=torch.Generator().manual_seed(9))
    mixed = _C.attention_seqs(q, kt, vt, *map(list, zip(*seqs)), 0.125)
    offset = 0
    for slot, start, n in seqs:
        alone = _C.attention_seqs(q[offset : offset + n], kt, vt, [slot], [start], [n], 0.125)
        assert torch.equal(mixed[offset : offset + n], alone), slot
        row = q[offset + n - 1 : offset + n]
        last = _C.attention_seqs(row, kt, vt, [slot], [start + n - 1], [1], 0.125)
        assert torch.equal(mixed[offset + n - 1 : offset + n], last), slot
        offset += n


def test_attention_rejects_a_bad_int8_cache() -> None:
    kv = _filled(1, 32, 64, seed=10)
    with pytest.raises(RuntimeError, match="float32, both float16 or both int8"):
        _C.attention(torch.randn(1, 2, 64), kv.k[0, 0], torch.randn(1, 32, 64), 0, 0.125, 0, 0.0)
    with pytest.raises(RuntimeError, match="an int8 cache's k_cache and v_cache"):
        _C.attention(torch.randn(1, 2, 32), kv.k[0, 0], kv.v[0, 0], 0, 0.125, 0, 0.0)


def test_native_layers_write_what_store_writes(tiny_llama) -> None:
    """The fused native layer stack quantizes in C++ (layer.cpp put_q8), the op-by-op path through
    KVCache.store: the same bytes, hence the same logits, each key shifted and scaled alike."""
    llm = LLM(str(tiny_llama), kernels="native", kv_cache_dtype="int8")
    model = llm.engine.model
    from specdec.model.llama import SeqBatch

    assert model.use_fused_layers and model.key_scale is not None
    ids = torch.tensor([5, 9, 12, 5, 9, 12, 5, 9, 3, 4, 5, 6, 7, 3, 4, 5, 6, 100, 7] * 2)
    results = []
    for fused in (True, False):
        model.use_fused_layers = fused
        kv = model.make_kv_cache(1, 64)
        h = model.forward(ids, torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv)
        results.append((model.compute_logits(h), kv.k.clone(), kv.v.clone()))
    model.use_fused_layers = True
    (la, ka, va), (lb, kb, vb) = results
    assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(la, lb)
    assert ka.abs().sum() > 0


def test_engine_with_an_int8_cache_speculates_exactly(tiny_llama, tiny_draft) -> None:
    prompts = [[5, 9, 12, 5, 9, 12, 5, 9], [3, 4, 5, 6, 7, 3, 4, 5, 6], [100, 7, 100, 7, 100]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_llama), kv_cache_dtype="q8_0")
    assert plain.engine.kv.k.dtype == plain.engine.kv.v.dtype == torch.int8
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    want_seeded = [o.outputs[0].token_ids for o in plain.generate(prompts, seeded)]
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "suffix", "num_speculative_tokens": 6},
        {"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 2},
        {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 3},
    ):
        spec["adaptive"] = False  # drafting must happen (the tiny models' drafts never pay)
        llm = LLM(str(tiny_llama), kv_cache_dtype="int8", speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want, spec
        got_seeded = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
        assert got_seeded == want_seeded, spec["method"]
        assert llm.engine.spec_stats.num_drafts > 0


def test_prefix_caching_over_an_int8_cache(tiny_llama) -> None:
    """Reused and copied prefixes (whole blocks and a partial last one) give plain's tokens."""
    shared = [7, 3, 9, 11, 4, 8, 2, 6, 10, 12, 5, 1, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    prompts = [shared + [30 + i, 40 + i] for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(tiny_llama), kv_cache_dtype="int8")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    cached = LLM(str(tiny_llama), kv_cache_dtype="int8", enable_prefix_caching=True, max_num_seqs=2)
    got = []
    for p in prompts:  # one at a time, so that each reuses a freed slot's prefix
        got += [o.outputs[0].token_ids for o in cached.generate([p], sp)]
    assert got == want
    assert cached.engine.kv.num_prefix_cache_hits > 0


def test_an_int8_budget_holds_more_sequences(tiny_llama) -> None:
    cfg = load_checkpoint(tiny_llama).arch
    per_slot = 64 * KVCache.bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float16
    )
    budget = 3 * per_slot  # three float16 slots
    q8 = LLM(str(tiny_llama), max_model_len=64, max_num_seqs=8, kv_cache_memory=budget,
             kv_cache_dtype="int8")  # fmt: skip
    bytes_q8 = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.int8)
    assert q8.engine.scheduler.max_num_seqs == budget // (64 * bytes_q8) > 3


def test_int8_needs_the_native_kernels(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="only the native CPU kernels read an 8-bit KV cache"):
        LLM(str(tiny_llama), kernels="torch", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of .*int8"):
        LLM(str(tiny_llama), kv_cache_dtype="int4")
