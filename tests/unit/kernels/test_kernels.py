"""Tests of specdec.kernels: formats, accuracy, batch invariance, torch/native agreement.

The native tests run once per available instruction set ("avx512" and "avx2" when the CPU and
the build have them, "portable" always).  Without the extension they skip locally but FAIL under CI (CI=... set),
since CI builds it.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from specdec import kernels as K
from tests.fixtures.kernels import (
    BATCH_SIZES,
    QUANT,
    _a8_weight,
    _has_avx512,
    _isas,
    _randn,
    _require_native,
    _weight,
    on_threads,
)

GGML_TYPE = {"q8_0": GT.Q8_0, "q4_0": GT.Q4_0, "q4_1": GT.Q4_1}


# ---------------------------------------------------------------------------------------------
# Formats


def _tricky_matrix(n: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0.0  # all-zero block
    w[1, :32] = 0.25  # constant block
    w[2, :32] = rng.standard_normal(32).astype(np.float32)
    w[2, 3], w[2, 9] = 3.0, -3.0  # |max| tie between signs
    w[3, :] *= 1e-5  # tiny scales: f16 subnormals
    w[4, :32] = np.arange(32, dtype=np.float32) - 15.5  # exact half-way points
    return w


@pytest.mark.parametrize("qtype", QUANT)
def test_quantize_weight_matches_gguf_bytes(qtype):
    w = _tricky_matrix(24, 96)
    ours = K.quantize_weight(torch.from_numpy(w), qtype)
    ref = gguf.quants.quantize(w, GGML_TYPE[qtype])
    assert ours.data.dtype == torch.uint8
    assert ours.data.shape == ref.shape
    np.testing.assert_array_equal(ours.data.numpy(), ref)


@pytest.mark.parametrize("qtype", QUANT)
def test_pack_gguf_bytes_dequantize_matches_gguf(qtype):
    w = _tricky_matrix(20, 128)
    raw = gguf.quants.quantize(w, GGML_TYPE[qtype])
    packed = K.pack_weight(qtype, torch.from_numpy(raw), 20, 128)
    assert (packed.qtype, packed.out_features, packed.in_features) == (qtype, 20, 128)
    assert packed.nbytes == raw.nbytes  # stays quantized
    ref = gguf.quants.dequantize(raw, GGML_TYPE[qtype])
    np.testing.assert_array_equal(packed.dequantize().numpy(), ref)
    rows = torch.tensor([3, 0, 19, 3])
    np.testing.assert_array_equal(packed.dequantize_rows(rows).numpy(), ref[rows.numpy()])
    raw.flags.writeable = False  # like a GGUFReader memmap; numpy input is accepted as well
    assert torch.equal(K.pack_weight(qtype, raw, 20, 128).data, packed.data)


@pytest.mark.parametrize("qtype", QUANT)
def test_native_dequantize_blocks_equals_torch_reference(qtype):
    # Random bytes: every scale a finite half (subnormals, negatives, both signs of zero) and
    # every quant value; the native rows (embedding lookups) must equal the torch reference's bits.
    _require_native()
    n, k = 37, 96
    bb = K.BLOCK_BYTES[qtype]
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (n, k // 32, bb), generator=gen, dtype=torch.uint8)
    halves = torch.randn(n, k // 32, 2, generator=gen).to(torch.float16)
    halves[0, 0] = torch.tensor([6e-8, -0.0], dtype=torch.float16)  # subnormal, negative zero
    scale_bytes = 4 if qtype == "q4_1" else 2
    blocks[..., :scale_bytes] = halves.view(torch.uint8).reshape(n, k // 32, 4)[..., :scale_bytes]
    blocks = blocks.reshape(n, -1).contiguous()
    ref = K._dequantize(qtype, blocks, n, k)
    got = K._C.dequantize_blocks(blocks, K._QT_CODE[qtype], k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K._C.dequantize_blocks(blocks, K._QT_CODE[qtype], 40)


def test_pack_f32_and_errors():
    w = _randn(6, 10)
    p = K.pack_weight("f32", w, 6, 10)
    assert p.nbytes == 6 * 10 * 4 and torch.equal(p.dequantize(), w)
    assert K.quantize_weight(w, "f32").qtype == "f32"
    with pytest.raises(ValueError):
        K.pack_weight("q5_k", w, 6, 10)
    with pytest.raises(ValueError):
        K.pack_weight("q8_0", torch.zeros(6, 34, dtype=torch.uint8), 6, 40)  # K % 32
    with pytest.raises(ValueError):
        K.pack_weight("q8_0", torch.zeros(6, 33, dtype=torch.uint8), 6, 32)  # wrong size
    with pytest.raises(TypeError):
        K.pack_weight("f32", w.double(), 6, 10)


# ---------------------------------------------------------------------------------------------
# Linear


@pytest.mark.parametrize("qtype", K.QTYPES)
def test_native_decode_is_exact(native, qtype):
    # Multiplying by the identity must give back gguf's dequantized values bit for bit.
    w = K.quantize_weight(torch.from_numpy(_tricky_matrix(13, 64)), qtype)
    y = native.linear(torch.eye(64), w)
    assert torch.equal(y, w.dequantize().T)


@pytest.mark.parametrize("qtype", QUANT)
def test_native_quantized_equals_f32_on_dequantized(native, qtype):
    # The quantized kernels run the f32 kernel's exact arithmetic on the decoded weights.
    w = _weight(qtype, 50, 128)
    wf = K.pack_weight("f32", w.dequantize().contiguous(), 50, 128)
    x = _randn(20, 128)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 20):
        assert torch.equal(native.linear(x[:m], w), native.linear(x[:m], wf)), m


@pytest.mark.parametrize("qtype", K.QTYPES)
@pytest.mark.parametrize("n,k", [(70, 96), (24, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_linear_accuracy(native, qtype, n, k, with_bias):
    if qtype == "f32" and k == 96:
        k = 100  # f32 also covers K % 8 != 0
    w = _weight(qtype, n, k)
    x = _randn(21, k)
    bias = _randn(n, seed=3) if with_bias else None
    y = native.linear(x, w, bias)
    wd = w.dequantize().double()
    ref = x.double() @ wd.T + (bias.double() if with_bias else 0.0)
    scale = x.double().abs() @ wd.abs().T + 1e-30  # error bound scale of a float32 dot product
    rel = ((y.double() - ref).abs() / scale).max().item()
    assert y.shape == (21, n) and y.dtype == torch.float32
    assert rel < 2e-6, rel


@pytest.mark.parametrize("qtype", K.QTYPES)
def test_native_linear_batch_invariant(native, qtype):
    n, k = 75, (100 if qtype == "f32" else 96)
    w = _weight(qtype, n, k)
    bias = _randn(n, seed=5)
    x = _randn(40, k)
    single = torch.cat([native.linear(x[i : i + 1], w, bias) for i in range(40)])
    for m in BATCH_SIZES:
        for off in {0, 40 - m, (40 - m) // 2}:
            y = native.linear(x[off : off + m], w, bias)
            assert torch.equal(y, single[off : off + m]), (m, off)


@pytest.mark.parametrize("qtype", K.QTYPES)
def test_native_linear_thread_invariant(native, qtype):
    # Large enough to be split across threads; results must not depend on the split.
    w = _weight(qtype, 600, 256)
    x = _randn(20, 256)
    one = on_threads(1, lambda: [native.linear(x[:m], w) for m in (1, 3, 20)])
    two = on_threads(2, lambda: [native.linear(x[:m], w) for m in (1, 3, 20)])
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert torch.equal(two[2][:3], two[1]) and torch.equal(two[2][:1], two[0])


@pytest.mark.parametrize("qtype", K.QTYPES)
def test_native_fused_weights_match_separate(native, qtype):
    parts = [_weight(qtype, n, 64, seed=n) for n in (24, 8, 8)]
    fused = K.concat_weights(parts)
    assert (fused.out_features, fused.in_features) == (40, 64)
    x = _randn(3, 64)
    assert torch.equal(native.linear(x, fused), torch.cat([native.linear(x, p) for p in parts], 1))
    with pytest.raises(ValueError):
        K.concat_weights([parts[0], _weight("f32" if qtype != "f32" else "q8_0", 8, 64)])


def test_native_concurrent_callers(native):
    # Several Python threads at once (the GIL is released): results stay exact.
    from concurrent.futures import ThreadPoolExecutor

    w = _weight("q4_1", 600, 256)
    x = _randn(5, 256)
    q, kc, vc = _randn(3, 6, 64, seed=2), _randn(2, 40, 64, seed=3), _randn(2, 40, 64, seed=4)
    want_y, want_a = native.linear(x, w), native.attention(q, kc, vc, 30, 0.125)

    def job(_):
        return all(
            torch.equal(native.linear(x, w), want_y)
            and torch.equal(native.attention(q, kc, vc, 30, 0.125), want_a)
            for _ in range(10)
        )

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(job, range(8)))


def test_native_linear_shapes_and_errors(native):
    w = _weight("q4_0", 8, 64)
    assert native.linear(_randn(2, 3, 64), w).shape == (2, 3, 8)
    x = _randn(64, 5)
    assert torch.equal(native.linear(x.T, w), native.linear(x.T.contiguous(), w))
    with pytest.raises(RuntimeError):
        native.linear(_randn(2, 32), w)
    with pytest.raises(RuntimeError):
        native.linear(_randn(2, 64).double(), w)


# ---------------------------------------------------------------------------------------------
# RMS norm


@pytest.mark.parametrize("k", [64, 100])
def test_native_rms_norm(native, k):
    x = _randn(40, k) * 3
    wt = _randn(k, seed=2)
    eps = 1e-5
    y = native.rms_norm(x, wt, eps)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * wt.double()
    torch.testing.assert_close(y.double(), ref, rtol=2e-6, atol=1e-6)
    single = torch.cat([native.rms_norm(x[i : i + 1], wt, eps) for i in range(40)])
    for m in BATCH_SIZES:
        for off in {0, 40 - m}:
            assert torch.equal(native.rms_norm(x[off : off + m], wt, eps), single[off : off + m])


@pytest.mark.parametrize("v", [1, 7, 63, 64, 100, 49152 + 5])
def test_native_argmax_first_maximum(native, v):
    g = torch.Generator().manual_seed(v)
    x = torch.randn(5, v, generator=g)
    # Row 1: the maximum twice (the first wins); row 2: all equal; row 3: maximum in the tail.
    if v > 2:
        x[1, v // 3] = x[1, -1] = 10.0
        x[3, -1] = 10.0
    x[2] = 0.5
    ref = [int(torch.nonzero(r == r.max())[0]) for r in x]
    assert native._C.argmax(x).tolist() == ref
    assert native._C.argmax(x[1:2]).tolist() == ref[1:2]


def test_native_argmax_nan_and_inf(native):
    nan, inf = float("nan"), float("inf")
    x = torch.full((4, 70), -inf)
    x[1, 0], x[1, 40] = nan, -3.0  # a NaN is never chosen over a number
    x[2, :] = nan
    x[3, 5], x[3, 69] = inf, inf
    assert native._C.argmax(x).tolist() == [0, 40, 0, 5]
    # with whether every row's maximum is finite (-inf, NaN and +inf maxima are not)
    assert native._C.argmax_finite(x) == ([0, 40, 0, 5], False)
    assert native._C.argmax_finite(x[1:2]) == ([40], True)
    for r in (0, 2, 3):
        assert native._C.argmax_finite(x[[1, r]]) == ([40, [0, 40, 0, 5][r]], False)


def test_argmax_rows_finite_agrees_with_torch(native):
    # the greedy step's one native call against the torch path it replaces on the CPU (and
    # still runs elsewhere): the same indices and the same verdict on non-finite maxima
    from specdec.sample.ops import argmax_rows_finite

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1000, generator=g)
    x[4, 17] = x[4, 900] = 9.0  # a tie: the first wins
    best, finite = argmax_rows_finite(x)
    assert best == x.argmax(dim=-1).tolist() and finite
    assert argmax_rows_finite(x.double()) == (best, True)  # not float32: torch's path
    x[2, 5] = float("nan")  # never chosen natively (a number is): as before, a finite maximum
    assert argmax_rows_finite(x) == (native._C.argmax(x).tolist(), True)
    x[2] = float("nan")  # no number in the row: both paths refuse it
    assert not argmax_rows_finite(x)[1] and not argmax_rows_finite(x.double())[1]
    x[2], x[5, 3] = 0.0, float("inf")
    assert not argmax_rows_finite(x)[1] and not argmax_rows_finite(x.double())[1]


# ---------------------------------------------------------------------------------------------
# Attention


def _attention_ref(q, kc, vc, start_pos, scale, window=0, softcap=0.0):
    q, kc, vc = q.double(), kc.double(), vc.double()
    t_rows, h, d = q.shape
    g = h // kc.shape[0]
    out = torch.zeros(t_rows, h, d, dtype=torch.float64)
    for t in range(t_rows):
        pos = start_pos + t
        lo = max(0, pos - window + 1) if window > 0 else 0
        for hh in range(h):
            k = kc[hh // g, lo : pos + 1]
            s = (k @ q[t, hh]) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            out[t, hh] = torch.softmax(s, 0) @ vc[hh // g, lo : pos + 1]
    return out


ATTN_CASES = [  # (H, Hkv, D, window, softcap)
    (9, 3, 64, 0, 0.0),  # GQA, like SmolLM2
    (4, 4, 32, 0, 0.0),  # MHA
    (4, 1, 20, 0, 0.0),  # MQA, D % 8 != 0
    (10, 2, 32, 0, 0.0),  # groups of 5 heads (processed as 4 + 1)
    (6, 1, 48, 5, 0.0),  # groups of 6 heads (4 + 2), window
    (6, 2, 64, 7, 0.0),  # sliding window
    (4, 2, 64, 0, 5.0),  # softcap
    (4, 2, 72, 11, 30.0),  # both, D not a multiple of 64
]


@pytest.mark.parametrize("h,hkv,d,window,softcap", ATTN_CASES)
def test_native_attention(native, h, hkv, d, window, softcap):
    seq, start = 60, 20
    kc = _randn(hkv, seq, d, seed=11)
    vc = _randn(hkv, seq, d, seed=12)
    q = _randn(40, h, d, seed=13) * 2
    scale = d**-0.5
    # Accuracy against float64.
    out = native.attention(q[:33], kc, vc, start, scale, window, softcap)
    ref = _attention_ref(q[:33], kc, vc, start, scale, window, softcap)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # Batch invariance: row t of a T-row call == that row alone at its position.
    single = torch.cat(
        [
            native.attention(q[t : t + 1], kc, vc, start + t, scale, window, softcap)
            for t in range(40)
        ]
    )
    for t_rows in BATCH_SIZES:
        for off in {0, 40 - t_rows}:
            got = native.attention(
                q[off : off + t_rows], kc, vc, start + off, scale, window, softcap
            )
            assert torch.equal(got, single[off : off + t_rows]), (t_rows, off)


def test_native_attention_strided_views(native):
    hkv, seq, d, h = 2, 30, 64, 6
    pool_k = _randn(hkv, 3, seq, d, seed=21)  # [Hkv, slots, L, D]: a slot is a strided view
    pool_v = _randn(hkv, 3, seq, d, seed=22)
    qkv = _randn(5, h * d + 2 * hkv * d, seed=23)  # q as a strided slice of a fused projection
    q = qkv[:, : h * d].reshape(5, h, d)
    kc, vc = pool_k[:, 1], pool_v[:, 1]
    assert not kc.is_contiguous() and not q.is_contiguous()
    got = native.attention(q, kc, vc, 10, 0.125)
    want = native.attention(q.contiguous(), kc.contiguous(), vc.contiguous(), 10, 0.125)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError):
        native.attention(q, kc, vc, 26, 0.125)  # start_pos + T > L


# ---------------------------------------------------------------------------------------------
# Torch ops and selection


@pytest.mark.parametrize("qtype", K.QTYPES)
def test_torch_and_native_agree(native, qtype):
    torch_ops = K.get_ops("torch")
    w = _weight(qtype, 48, 128)
    x = _randn(5, 128)
    bias = _randn(48, seed=4)
    torch.testing.assert_close(
        native.linear(x, w, bias), torch_ops.linear(x, w, bias), rtol=1e-4, atol=1e-5
    )
    wt = _randn(128, seed=6)
    torch.testing.assert_close(
        native.rms_norm(x, wt, 1e-6), torch_ops.rms_norm(x, wt, 1e-6), rtol=1e-5, atol=1e-6
    )
    kc, vc = _randn(2, 16, 32, seed=7), _randn(2, 16, 32, seed=8)
    q = _randn(3, 4, 32, seed=9)
    for window, cap in [(0, 0.0), (4, 0.0), (0, 20.0)]:
        torch.testing.assert_close(
            native.attention(q, kc, vc, 9, 0.2, window, cap),
            torch_ops.attention(q, kc, vc, 9, 0.2, window, cap),
            rtol=1e-5,
            atol=1e-5,
        )


def test_torch_ops_reference_and_cache():
    ops = K.get_ops("torch")
    assert ops.name == "torch"
    w = _weight("q4_1", 16, 64)
    x = _randn(3, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.dequantize().T)
    assert w.float_weight("cpu") is w.float_weight("cpu")  # dequantized once
    kc, vc = _randn(3, 12, 16, seed=7), _randn(3, 12, 16, seed=8)
    q = _randn(4, 6, 16, seed=9)
    ref = _attention_ref(q, kc, vc, 5, 0.25, 3, 10.0)
    torch.testing.assert_close(
        ops.attention(q, kc, vc, 5, 0.25, 3, 10.0).double(), ref, rtol=1e-5, atol=1e-6
    )


def test_get_ops_selection():
    assert isinstance(K.get_ops("torch"), K.TorchOps)
    assert isinstance(K.get_ops("auto", "cuda"), K.TorchOps)
    with pytest.raises(ValueError):
        K.get_ops("bogus")
    with pytest.raises(RuntimeError):
        K.get_ops("native", "cuda")
    feats = K.cpu_features()
    assert {"avx2", "fma", "f16c"} <= set(feats) and all(
        isinstance(v, bool) for v in feats.values()
    )
    if K.native_available():
        assert K.get_ops("auto").name == "native"
        assert K.get_ops("native").name == "native"
    else:
        assert K.get_ops("auto").name == "torch"
        with pytest.raises(RuntimeError, match="native kernels unavailable"):
            K.get_ops("native")


def test_native_built_in_ci():
    _require_native()
    feats = K.cpu_features()
    if feats["avx2"] and feats["fma"] and feats["f16c"]:
        assert K._C.has_avx2_build(), "x86 CPU with AVX2 but the AVX2 kernels were not built"
        assert K._C.has_avx512_build(), "x86 CPU with AVX2 but the AVX-512 kernels were not built"
        if not os.environ.get("SPECDEC_KERNELS_ISA"):
            assert K.native_isa() == ("avx512" if _has_avx512(feats) else "avx2")


# ---------------------------------------------------------------------------------------------
# 8-bit activation kernels (PackedWeight.enable_a8)


def _a8_reference(x: torch.Tensor, w: K.PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 x_q @ W.T: activations quantized per block of 32 as the kernels define it."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(xb * inv[..., None]).clamp(-128, 127)  # round half to even, as cvtps2dq
    y = (xq * d[..., None]).reshape(m, k).double() @ w.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("qtype", QUANT)  # K-quants: test_kquants.py
@pytest.mark.parametrize("with_bias", [False, True])
def test_a8_linear_matches_quantized_reference(native, qtype, with_bias):
    w = _a8_weight(qtype, 48, 96)
    bias = _randn(48, seed=3) if with_bias else None
    x = _randn(11, 96) * 2
    x[3, :32] = 0.0  # an all-zero activation block (scale 0)
    y = native.linear(x, w, bias)
    ref = _a8_reference(x, w, bias)
    assert (y.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
    # It is a different computation from the float kernels: close, not equal.
    w_float = K.pack_weight(qtype, w.data, 48, 96)
    diff = (y - native.linear(x, w_float, bias)).abs().max().item()
    assert 0 < diff < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("qtype", QUANT)  # K-quants: test_kquants.py
@pytest.mark.parametrize("k", [64, 32, 96, 544])
def test_a8_linear_batch_invariant(native, qtype, k):
    # 5 tile groups: the two-group tiles and a one-group tail.  From 5 rows on, the VNNI kernel
    # runs rows in tiles of up to 16 (17 rows: 9 + 8; 33: 11 x 3) over two 32-blocks at a time
    # below 10 rows: k = 32 and 96 (1 and 3 blocks) leave a single-block tail.  k = 544 (17
    # blocks): the batch quantizers' 16- and 8-block steps and their tails (a row alone takes 16
    # blocks of its row at a time on the weight-stationary walk, one block at a time on the
    # groups walk; a batch, 16 rows of a block).
    w = _a8_weight(qtype, 80, k)
    bias = _randn(80, seed=5)
    x = _randn(40, k)
    single = torch.cat([native.linear(x[i : i + 1], w, bias) for i in range(40)])
    for m in BATCH_SIZES:
        for off in {0, 40 - m, (40 - m) // 2}:
            assert torch.equal(native.linear(x[off : off + m], w, bias), single[off : off + m])


def test_a8_kernels_agree_across_isas():
    # The VNNI kernels and their scalar twin do the same integer sums and the same float
    # operations, so they agree bit for bit (this is what lets the twin stand in anywhere).
    _require_native()
    results = {}
    for isa in _isas():
        K.set_native_isa(isa)
        try:
            ops = K.get_ops("native")
            for qtype in QUANT:
                for m, k in [
                    (9, 128),
                    (3, 96),
                    (6, 96),
                    (16, 160),
                    (21, 64),
                    (1, 544),
                    (7, 544),
                    (20, 1024),
                ]:
                    w = _a8_weight(qtype, 64, k, seed=2)
                    y = ops.linear(_randn(m, k) * 3, w, None)
                    results.setdefault((qtype, m, k), {})[isa] = y
        finally:
            K.set_native_isa("auto")
    for qtype, by_isa in results.items():
        first = next(iter(by_isa.values()))
        for isa, y in by_isa.items():
            assert torch.equal(y, first), (qtype, isa)


def test_a8_vnni256_kernels_equal_the_vpmaddubsw_ones():
    # The AVX2 table's 8-bit activation kernels on 256-bit VNNI (AVX-VNNI, or the same code in
    # AVX-512 VNNI's 256-bit form) take the vpmaddubsw kernels' tiles and float steps: the same
    # results bit for bit, a row alone and in any batch; the switch picks between them, and
    # Q8_0 weights take 8-bit activations only with VNNI.
    _require_native()
    if "avx2" not in _isas():
        pytest.skip("no AVX2 CPU or build")
    feats = K.cpu_features()
    has256 = feats.get("avxvnni", False) or (
        feats.get("avx512vnni", False) and feats["avx512f"] and feats["avx512vl"]
    )
    named = ("avx-vnni" if feats.get("avxvnni", False) else "avx2-vnni") if has256 else "avx2"
    ops = K.get_ops("native")
    ys = {}
    K.set_native_isa("avx2")
    try:
        for on in (True, False):
            K._C.set_a8_vnni256(on)
            assert K.a8_kernels() == (named if on else "avx2")
            assert K.int8_activations_pay("q8_0") == (on and has256)
            assert K.int8_activations_pay("q4_1")
            for qtype in QUANT:
                w = _a8_weight(qtype, 80, 96, seed=7)
                x = _randn(33, 96, seed=8) * 3
                single = torch.cat([ops.linear(x[i : i + 1], w, None) for i in range(33)])
                for m in BATCH_SIZES:
                    assert torch.equal(ops.linear(x[:m], w, None), single[:m]), (qtype, on, m)
                ys[qtype, on] = single
    finally:
        K._C.set_a8_vnni256(True)
        K.set_native_isa("auto")
    for qtype in QUANT:
        assert torch.equal(ys[qtype, True], ys[qtype, False]), qtype


def test_a8_thread_invariant_and_errors():
    _require_native()
    w = _a8_weight("q4_1", 640, 256)
    ops = K.get_ops("native")
    for m in (3, 7, 16, 20):  # small-M tiles, ws2_tile, one and two row tiles (one shared layout)
        x = _randn(m, 256, seed=m)
        assert torch.equal(on_threads(1, ops.linear, x, w), on_threads(2, ops.linear, x, w)), m
    with pytest.raises(ValueError, match="out_features % 16"):
        _weight("q4_1", 40, 64).enable_a8()
    with pytest.raises(ValueError, match="8-bit activations"):
        _f32_weight().enable_a8()
    w.disable_a8()
    assert w.a8 is None


@pytest.mark.parametrize("qtype", QUANT)
def test_a8_tiles_replace_the_blocks(qtype):
    # enable_a8 keeps only the tiles; the blocks come back from them byte for byte (all rows,
    # chosen rows, the float path after disable_a8), and tiles made from fused parts equal the
    # tiles of the fused weight.
    _require_native()
    w = _weight(qtype, 48, 96, seed=4)
    blocks = w.data.clone()
    w.enable_a8()
    assert not w.holds_blocks and w.nbytes == w.a8.numel()
    assert torch.equal(w.data, blocks)
    rows = torch.tensor([47, 0, 16, 0])
    assert torch.equal(
        w.dequantize_rows(rows), K.pack_weight(qtype, blocks, 48, 96).dequantize()[rows]
    )
    code = K._QT_CODE[qtype]
    assert torch.equal(K._C.unpack_a8(w.a8, code, 48, 96, rows), blocks[rows])
    parts = K.PackedWeight.from_a8_parts(
        qtype, [blocks[:16], blocks[16:40], blocks[40:]], [16, 24, 8], 96
    )
    assert torch.equal(parts.a8, w.a8) and parts.out_features == 48
    with pytest.raises(RuntimeError, match="out of range"):
        K._C.unpack_a8(w.a8, code, 48, 96, torch.tensor([48]))
    w.disable_a8()
    assert w.holds_blocks and w.a8 is None and torch.equal(w.data, blocks)


def _f32_weight() -> K.PackedWeight:
    return K.pack_weight("f32", _randn(32, 64), 32, 64)


def test_int8_activations_fast_reflects_cpu():
    _require_native()
    feats = K.cpu_features()
    has_vnni = feats.get("avx512vnni", False) and _has_avx512(feats)
    assert K.kquant_float_fast() == (has_vnni and K.native_isa() == "avx512")
    # Q8_0 / Q4_0 / Q4_1 and K-quants: VNNI, else AVX2's vpmaddubsw kernels, wherever a vector
    # table runs
    has_avx2 = all(feats.get(f, False) for f in ("avx2", "fma", "f16c"))
    vector = K.native_isa() in ("avx2", "avx512")
    assert K.int8_activations_fast() == (vector and (has_vnni or has_avx2))
    assert K.kquant_int8_fast() == (vector and (has_vnni or has_avx2))
    vnni_now = has_vnni and K.native_isa() == "avx512"
    avx2_a8 = "avx-vnni" if feats.get("avxvnni", False) else "avx2"
    assert K._C.kq_kernels() == (
        "portable" if not vector else "avx512vnni" if vnni_now else avx2_a8
    )
    expected = "portable" if not vector else (avx2_a8 if not has_vnni else K.a8_kernels())
    assert K.a8_kernels() == expected
    try:
        K.set_native_isa("portable")
        assert not K.int8_activations_fast() and K.a8_kernels() == "portable"
        assert not K.kquant_int8_fast() and K._C.kq_kernels() == "portable"
    finally:
        K.set_native_isa("auto")
