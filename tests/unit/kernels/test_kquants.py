"""Native GGUF K-quants (Q4_K, Q5_K, Q6_K): exact dequantization against `gguf`, the float and
8-bit activation kernels (accuracy, batch and thread invariance, AVX-512 VNNI equal to the
scalar twin), fused weights mixing formats, and a tiny K-quant GGUF that loads natively and
decodes the same alone and batched.

`gguf` has no K-quant quantizer and llama.cpp's is not in CI, so the tensors are built here:
random blocks (every bit pattern of codes and scales) and a simple quantizer for model weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from specdec import kernels as K
from tests.fixtures.kquants import (
    GGML,
    MIXES,
    quantize,
    write_kquant_gguf,
)

KQ = K.KQUANT_QTYPES


def _avx512_usable() -> bool:
    feats = K.cpu_features()
    return all(feats.get(f, False) for f in ("avx512f", "avx512dq", "avx512bw", "avx512vl"))


def _avx2_usable() -> bool:
    feats = K.cpu_features()
    return all(feats.get(f, False) for f in ("avx2", "fma", "f16c"))


def _isas() -> list[str]:
    """The kernel tables to compare: AVX-512 (VNNI where the CPU has it, in both of its walks of a
    product: "avx512" the groups walk, "avx512-stationary" the weight-stationary one), AVX2 and
    the scalar twins, as far as this CPU and build run them."""
    isas = []
    if K.native_available() and K._C.has_avx512_build() and _avx512_usable():
        isas.append("avx512")
        if K._C.a8_available():
            isas.append("avx512-stationary")
    if K.native_available() and K._C.has_avx2_build() and _avx2_usable():
        isas.append("avx2")
        if _vnni256():  # "avx2" runs on 256-bit VNNI then: the vpmaddubsw kernels too
            isas.append("avx2-maddubs")
    return isas + ["portable"]


def _vnni256() -> bool:
    """Whether the AVX2 table's 8-bit kernels run on 256-bit VNNI here (AVX-VNNI, or AVX-512
    VNNI + VL)."""
    feats = K.cpu_features()
    return feats.get("avxvnni", False) or all(
        feats.get(f, False) for f in ("avx512f", "avx512vl", "avx512vnni")
    )


def _set_isa(isa: str) -> None:
    """Select a table of _isas() (the AVX-512 one with its walk), or "auto" again."""
    K.set_native_isa(isa.removesuffix("-stationary").removesuffix("-maddubs"))
    if K.native_available():
        K._C.set_a8_vnni256(isa != "avx2-maddubs")
    if K.native_available() and hasattr(K._C, "set_a8_walk"):
        walk = {"avx512": "groups", "avx512-stationary": "stationary"}.get(isa, "auto")
        K._C.set_a8_walk(walk)


@pytest.fixture(params=_isas())
def native(request):
    if not K.native_available():
        pytest.fail(f"native kernels not built: {K.native_unavailable_reason()}")
    _set_isa(request.param)
    try:
        yield K.get_ops("native")
    finally:
        _set_isa("auto")


# ---------------------------------------------------------------------------------------------
# Building K-quant tensors


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: random bytes (every code and scale pattern) with finite f16 scales:
    normal, subnormal, zero and negative ones."""
    rng = np.random.default_rng(seed)
    nb, bb = k // 256, K.KQUANT_GGUF_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)

    def f16(scale: float) -> np.ndarray:
        v = rng.standard_normal((n, nb)) * scale
        v.flat[::7] = 3e-7  # f16 subnormal
        v.flat[::11] = 0.0
        return v.astype(np.float16).view(np.uint8).reshape(n, nb, 2)

    if qtype == "q6_k":
        raw[..., 208:210] = f16(1e-3)
    else:
        raw[..., 0:2] = f16(1e-3)
        raw[..., 2:4] = f16(1e-3)
    return raw.reshape(n, nb * bb)


def _deq(raw: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGML[qtype])


def _randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _packed(qtype: str, n: int, k: int, seed: int = 0) -> tuple[K.PackedWeight, np.ndarray]:
    raw = random_blocks(qtype, n, k, seed)
    return K.pack_weight(qtype, raw, n, k), raw


# ---------------------------------------------------------------------------------------------
# Formats


@pytest.mark.parametrize("qtype", KQ)
def test_quantizer_helper_is_close(qtype):
    w = np.random.default_rng(3).standard_normal((16, 512)).astype(np.float32) * 0.05
    back = _deq(quantize(w, qtype), qtype).reshape(w.shape)
    bits = {"q4_k": 4, "q5_k": 5, "q6_k": 6}[qtype]
    assert np.abs(back - w).max() < 0.3 * 2 ** (4 - bits) * np.abs(w).max()


@pytest.mark.parametrize("qtype", KQ)
def test_dequantize_is_exact_and_size_kept(qtype):
    raw = random_blocks(qtype, 48, 768, seed=1)
    w = K.pack_weight(qtype, raw, 48, 768)
    assert (w.qtype, w.out_features, w.in_features, w.parts) == (qtype, 48, 768, ((qtype, 48),))
    assert w.nbytes == raw.nbytes  # tiles replace the GGUF blocks, byte for byte
    ref = _deq(raw, qtype)
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)
    rows = torch.tensor([3, 0, 47, 17, 3])
    np.testing.assert_array_equal(w.dequantize_rows(rows).numpy(), ref[rows.numpy()])
    raw.flags.writeable = False  # a GGUFReader memmap
    assert torch.equal(K.pack_weight(qtype, raw, 48, 768).data, w.data)


def test_pack_errors():
    raw = random_blocks("q4_k", 16, 256)
    with pytest.raises(ValueError, match="N % 16"):
        K.pack_weight("q4_k", raw[:8], 8, 256)
    with pytest.raises(ValueError, match="bytes"):
        K.pack_weight("q4_k", raw[:, :100], 16, 256)
    with pytest.raises(TypeError):
        K.pack_weight("q4_k", torch.zeros(16, 144, dtype=torch.int8), 16, 256)
    assert K.kquant_supported("q6_k", 32, 512) and not K.kquant_supported("q6_k", 40, 512)
    assert not K.kquant_supported("q6_k", 32, 576) and not K.kquant_supported("q8_0", 32, 512)


# ---------------------------------------------------------------------------------------------
# Float activations


@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("with_bias", [False, True])
def test_float_path_accuracy(native, qtype, with_bias):
    w, raw = _packed(qtype, 48, 768, seed=2)
    wd = torch.from_numpy(_deq(raw, qtype)).double()
    bias = _randn(48, seed=4) if with_bias else None
    x = _randn(7, 768)
    y = native.linear(x, w, bias).double()
    ref = x.double() @ wd.T + (bias.double() if with_bias else 0.0)
    scale = x.double().abs() @ wd.abs().T + 1e-30  # four float32 chains of 192 products
    assert ((y - ref).abs() / scale).max().item() < 1e-5


@pytest.mark.parametrize("qtype", KQ)
def test_float_path_batch_invariant(native, qtype):
    w, _ = _packed(qtype, 48, 512, seed=3)
    bias = _randn(48, seed=4)
    x = _randn(24, 512)
    single = torch.cat([native.linear(x[i : i + 1], w, bias) for i in range(24)])
    for m in list(range(1, 17)) + [20, 24]:
        for off in {0, 24 - m}:
            assert torch.equal(native.linear(x[off : off + m], w, bias), single[off : off + m])


def test_torch_ops_use_the_exact_dequantization():
    w, raw = _packed("q5_k", 32, 256)
    x = _randn(3, 256)
    ref = x @ torch.from_numpy(_deq(raw, "q5_k")).T
    assert torch.equal(K.get_ops("torch").linear(x, w), ref)


# ---------------------------------------------------------------------------------------------
# 8-bit activations


def _q8k(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize it (per block of 256: dk = amax / 127, codes round half to even),
    in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 256, 256)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(xb * inv[..., None]).clamp(-128, 127)
    return (xq.double() * d.double()[..., None]).reshape(m, k)


@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("with_bias", [False, True])
def test_a8_accuracy(native, qtype, with_bias):
    w, raw = _packed(qtype, 64, 768, seed=3)
    w.enable_a8()
    assert w.a8 is w.data  # no second copy
    wd = torch.from_numpy(_deq(raw, qtype)).double()
    bias = _randn(64, seed=5) if with_bias else None
    x = _randn(9, 768) * 2
    x[2, :256] = 0.0  # a zero block (scale 0)
    x[4, 300] = 40.0  # an outlier: that block's other codes get coarse
    y = native.linear(x, w, bias).double()
    b = bias.double() if with_bias else 0.0
    # Against the quantized activations: only float32 rounding (per block sums < 2^28 are exact).
    ref_q = _q8k(x) @ wd.T + b
    scale = _q8k(x).abs() @ wd.abs().T + 1e-30
    assert ((y - ref_q).abs() / scale).max().item() < 2e-6
    # Against float64 x @ W.T: within the activation rounding, |dk| / 2 per element.
    ref = x.double() @ wd.T + b
    dk = x.reshape(9, 3, 256).abs().amax(-1).double() / 127
    bound = (dk / 2).repeat_interleave(256, 1) @ wd.abs().T
    assert ((y - ref).abs() <= bound * 1.001 + 1e-6 * scale).all()


@pytest.mark.parametrize("qtype", KQ)
def test_a8_batch_invariant(native, qtype):
    w, _ = _packed(qtype, 80, 512, seed=4)  # 5 tile groups: pairs and a single one
    w.enable_a8()
    bias = _randn(80, seed=6)
    x = _randn(40, 512)
    single = torch.cat([native.linear(x[i : i + 1], w, bias) for i in range(40)])
    for m in list(range(1, 17)) + [17, 33]:
        for off in {0, 40 - m, (40 - m) // 2}:
            assert torch.equal(native.linear(x[off : off + m], w, bias), single[off : off + m])


def _by_isa(a8: bool, qtypes, ms, ks, n: int = 48) -> dict[str, list[torch.Tensor]]:
    """Each table's outputs for random tiles of each format, M rows and K inputs (with a bias)."""
    results: dict[str, list[torch.Tensor]] = {}
    for isa in _isas():
        _set_isa(isa)
        try:
            ops = K.get_ops("native")
            for k in ks:
                for qtype in qtypes:
                    w, _ = _packed(qtype, n, k, seed=7 + k)
                    if a8:
                        w.enable_a8()
                    bias = _randn(n, seed=k)
                    for m in ms:
                        x = _randn(m, k, seed=m) * 3
                        x[0, :7] = 1e3  # one block's other codes near zero
                        results.setdefault(isa, []).append(ops.linear(x, w, bias))
        finally:
            _set_isa("auto")
    return results


@pytest.mark.parametrize("a8", [False, True])
def test_vnni_equals_scalar_twin(a8):
    # Same integer sums and float operations: bit for bit (the twin runs where VNNI does not),
    # with int8 activations and with float ones.
    results = _by_isa(a8, KQ, (1, 4, 7), (1024,))
    first = results["portable"]
    for isa, ys in results.items():
        assert all(torch.equal(a, b) for a, b in zip(ys, first)), isa


@pytest.mark.skipif("avx2" not in _isas(), reason="needs the AVX2 kernels and an AVX2 CPU")
@pytest.mark.parametrize("qtype", KQ)
def test_avx2_equals_scalar_twin(qtype):
    # kernels_avx2_kq.cpp: the int8 path bit for bit the twins' (and so the VNNI kernels'), for
    # each row-pass shape (passes of 8 plus the rest; one row, and two for Q4_K / Q5_K, take the
    # kernels that do both halves of a tile at once, the others those that do one half at a
    # time) and several K.
    assert K._C.kq_kernels() in ("avx2", "avx512vnni")
    _set_isa("avx2")
    try:  # on 256-bit VNNI where the CPU has it (kq_vnni256.h), else vpmaddubsw
        vnni = "avx-vnni" if K.cpu_features().get("avxvnni", False) else "avx2-vnni"
        assert K._C.kq_kernels() == (vnni if _vnni256() else "avx2")
    finally:
        _set_isa("auto")
    results = _by_isa(True, (qtype,), (1, 2, 3, 4, 5, 7, 8, 9, 19), (256, 768, 2048), n=32)
    assert len(results["avx2"]) == len(results["portable"]) == 27
    for isa, ys in results.items():
        for i, (a, b) in enumerate(zip(ys, results["portable"])):
            assert torch.equal(a, b), (isa, i, (a - b).abs().max().item())


def extreme_blocks(qtype: str, n: int, k: int) -> np.ndarray:
    """Every code and scale byte at its maximum (0xFF), finite f16 scales: the largest integer
    sums the kernels meet (their int16 partial sums must not overflow)."""
    raw = random_blocks(qtype, n, k).reshape(n, k // 256, -1)
    keep = raw[..., 208:210].copy() if qtype == "q6_k" else raw[..., 0:4].copy()
    raw[...] = 0xFF
    if qtype == "q6_k":
        raw[..., 208:210] = keep
    else:
        raw[..., 0:4] = keep
    return raw.reshape(n, -1)


@pytest.mark.skipif("avx2" not in _isas(), reason="needs the AVX2 kernels and an AVX2 CPU")
@pytest.mark.parametrize("qtype", KQ)
def test_avx2_extreme_sums_equal_scalar_twin(qtype):
    # Maximal codes against activations whose codes are all +127 or -127 (and mixed).
    n, k = 32, 512
    w = K.pack_weight(qtype, extreme_blocks(qtype, n, k), n, k)
    w.enable_a8()
    x = torch.ones(8, k)
    x[1::4] = -1.0
    x[2::4, ::2] = -1.0
    x[3::4, 256:] = -1.0
    ys = {}
    for isa in [i for i in _isas() if i.startswith("avx2")] + ["portable"]:
        _set_isa(isa)
        try:
            ys[isa] = [K.get_ops("native").linear(x[:m], w) for m in (1, 2, 4, 5, 8)]
        finally:
            _set_isa("auto")
    for isa, y in ys.items():
        assert all(torch.equal(a, b) for a, b in zip(y, ys["portable"])), isa


@pytest.mark.parametrize("a8", [False, True])
def test_thread_invariant(a8):
    ops = K.get_ops("native")
    w, _ = _packed("q4_k", 640, 512, seed=8)
    if a8:
        w.enable_a8()
    x = _randn(20, 512)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [ops.linear(x[:m], w) for m in (1, 3, 20)]
        torch.set_num_threads(2)
        two = [ops.linear(x[:m], w) for m in (1, 3, 20)]
    finally:
        torch.set_num_threads(prev)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(two[2][:3], two[1]) and torch.equal(two[2][:1], two[0])


@pytest.mark.parametrize("a8", [False, True])
def test_fused_parts_of_mixed_formats(native, a8):
    # Q4_K_M's q|k|v with v in Q6_K: one weight whose parts keep their formats.
    parts = [_packed(qt, n, 512, seed=n)[0] for qt, n in (("q4_k", 48), ("q6_k", 16), ("q5_k", 32))]
    fused = K.concat_weights(parts)
    assert fused.qtype == "q4_k+q6_k+q5_k" and fused.out_features == 96
    assert fused.parts == (("q4_k", 48), ("q6_k", 16), ("q5_k", 32))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    rows = torch.tensor([50, 2, 95])
    assert torch.equal(fused.dequantize_rows(rows), fused.dequantize()[rows])
    for w in [fused, *parts] if a8 else []:
        w.enable_a8()
    bias = _randn(96, seed=9)
    x = _randn(6, 512)
    want = torch.cat(
        [native.linear(x, p, bias[i : i + p.out_features]) for p, i in zip(parts, (0, 48, 64))], 1
    )
    assert torch.equal(native.linear(x, fused, bias), want)
    with pytest.raises(ValueError):
        K.concat_weights([parts[0], K.quantize_weight(_randn(16, 512), "q8_0")])


def test_loader_keeps_kquants_native_where_int8_is_fast(monkeypatch):
    from specdec.model.layers import pack_linear
    from specdec.model.loader import RawTensor

    raws = [
        RawTensor(qt, random_blocks(qt, n, 512, seed=n), (n, 512))
        for qt, n in (("q4_k", 32), ("q4_k", 16), ("q6_k", 16))
    ]
    ops = K.get_ops("native")
    for fast in (True, False):
        monkeypatch.setattr(K, "kquant_int8_fast", lambda fast=fast: fast)
        w = pack_linear(raws, "auto", ops, torch.device("cpu"), a8=True)
        assert w.qtype == ("q4_k+q6_k" if fast else "q8_0")
        # float activations keep them only where their float kernels are vector ones (AVX-512)
        w_float = pack_linear(raws, "auto", ops, torch.device("cpu"), a8=False)
        assert w_float.qtype == ("q4_k+q6_k" if fast and K.kquant_float_fast() else "q8_0")
        if fast:
            assert w.nbytes == sum(r.data.nbytes for r in raws)
            want = np.concatenate([_deq(r.data, r.qtype) for r in raws])
            np.testing.assert_array_equal(w.dequantize().numpy(), want)
        # explicit choices are honoured either way
        assert pack_linear(raws[:1], "q4_0", ops, torch.device("cpu")).qtype == "q4_0"
        assert pack_linear(raws[:1], "fp32", ops, torch.device("cpu")).qtype == "f32"
    # A K-quant fused with another format: the K-quant counts as Q8_0, then the most precise wins.
    monkeypatch.setattr(K, "kquant_int8_fast", lambda: True)
    monkeypatch.setattr(K, "kquant_float_fast", lambda: True)
    q4_0 = RawTensor("q4_0", K.quantize_weight(_randn(16, 512), "q4_0").data.numpy(), (16, 512))
    assert pack_linear([raws[0], q4_0], "auto", ops, torch.device("cpu")).qtype == "q8_0"
    f16 = RawTensor("f16", np.zeros((16, 512), dtype=np.float16), (16, 512))
    assert pack_linear([raws[0], f16], "auto", ops, torch.device("cpu")).qtype == "f32"


def test_linear_rejects_bad_parts():
    w, _ = _packed("q4_k", 32, 256)
    x = _randn(2, 256)
    kq = int(K._C.QT_KQUANT)
    with pytest.raises(RuntimeError, match="parts"):
        K._C.linear(x, w.data, kq, 32, 256, None, [])
    with pytest.raises(RuntimeError, match="rows"):
        K._C.linear(x, w.data, kq, 32, 256, None, [4, 16])
    with pytest.raises(RuntimeError, match="bytes"):
        K._C.linear(x, w.data, kq, 32, 256, None, [6, 32])


# ---------------------------------------------------------------------------------------------
# A tiny K-quant GGUF end to end


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_kquant_gguf_loads_native_and_decodes_batch_invariant(mix, mk, tmp_path):
    from specdec import LLM, SamplingParams

    path = write_kquant_gguf(mk, tmp_path / f"tiny-{mix}.gguf", mix)
    plain = LLM(str(path), max_model_len=256)
    model = plain.engine.model
    rest = MIXES[mix][2]
    layer0, layer1 = model.layers[0], model.layers[1]
    if K.kquant_int8_fast():  # K-quants stay native, int8 activations
        assert layer0.qkv.weight.qtype == f"{rest}+q6_k"  # q|k in one format, v in Q6_K
        assert layer1.qkv.weight.qtype == rest and layer1.gate_up.weight.qtype == rest
        assert layer0.down.weight.qtype == "q6_k" and model.lm_head.weight.qtype == "q6_k"
        assert model.activation_dtype == "int8" and model.use_fused_layers
    else:  # converted to Q8_0, as before native K-quants
        assert {lin.weight.qtype for lin in model.linears()} == {"q8_0"}
    prompts = ["a b c a b c a b", "def f(x):\n    return", "Once upon a time"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    alone = [plain.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone and all(len(t) == 16 for t in batched)
    assert len({tuple(t) for t in batched}) > 1  # not a degenerate model
    spec = LLM(str(path), max_model_len=256, speculative_config={"method": "ngram"})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == batched
    # Float activations read the same tiles: also batch-invariant.
    model.set_activation_dtype("float32")
    float_batched = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    assert float_batched == [plain.generate([p], sp)[0].outputs[0].token_ids for p in prompts]


def test_kquant_model_fused_layers_equal_python_layers(mk, tmp_path):
    from specdec.kernels import get_ops
    from specdec.model.llama import LlamaModel, SeqBatch
    from specdec.model.loader import load_checkpoint

    path = write_kquant_gguf(mk, tmp_path / "tiny-Q4_K_M.gguf", "Q4_K_M", seed=1)
    cpu = torch.device("cpu")
    model = LlamaModel(load_checkpoint(path), get_ops("native"), cpu, torch.float32, "auto", 64)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (20,), generator=gen)
    by_dtype = {}
    for activations in ("int8", "float32"):
        model.set_activation_dtype(activations)
        logits = []
        for fused in (False, True):
            model.use_fused_layers = fused
            kv = model.make_kv_cache(1, 64)
            h = model.forward(prompt, torch.arange(20), SeqBatch([0], [0], [20]), kv)
            logits.append(model.compute_logits(h))
        assert torch.equal(logits[0], logits[1]), activations
        by_dtype[activations] = logits[1]
    # Int8 activations stay close to the float ones (random weights: loose).
    a, b = by_dtype["int8"], by_dtype["float32"]
    assert not torch.equal(a, b) and (a - b).abs().max().item() < 0.2 * b.abs().max().item()


class _Recorder:
    """Kernel ops that record every linear call (x, weight, bias, y) of a forward."""

    def __init__(self, ops) -> None:
        self.ops, self.calls = ops, []

    def linear(self, x, w, bias=None):
        y = self.ops.linear(x, w, bias)
        self.calls.append((x.clone(), w, bias, y.clone()))
        return y


@pytest.mark.skipif("avx2" not in _isas(), reason="needs the AVX2 kernels and an AVX2 CPU")
def test_kquant_gguf_on_avx2_stays_native_and_equals_scalar_twin(mk, tmp_path):
    # A tiny Q4_K_M file loaded on the AVX2 table keeps its K-quant tiles (no Q8_0 copy) and runs
    # int8 activations; every linear of a forward equals the scalar twins' bit for bit on the
    # same input, fused layers give the same logits, and the twins' whole forward (whose other
    # float kernels, rms_norm and attention, round differently) stays close.
    from specdec.kernels import get_ops
    from specdec.model.llama import LlamaModel, SeqBatch
    from specdec.model.loader import load_checkpoint

    path = write_kquant_gguf(mk, tmp_path / "tiny-Q4_K_M.gguf", "Q4_K_M", seed=2)
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(1))
    ops = get_ops("native")
    logits = {}
    try:
        K.set_native_isa("avx2")
        cpu = torch.device("cpu")
        model = LlamaModel(load_checkpoint(path), ops, cpu, torch.float32, "auto", 64, "auto")
        qtypes = {lin.weight.qtype for lin in model.linears()}
        assert qtypes == {"q4_k", "q6_k", "q4_k+q6_k"}, qtypes
        assert model.activation_dtype == "int8"
        assert all(lin.weight.a8 is lin.weight.data for lin in model.linears())  # one copy
        rec = _Recorder(ops)
        for lin in model.linears():
            lin.ops = rec
        for isa in ("avx2", "portable"):
            K.set_native_isa(isa)
            for fused in (False, True):
                model.use_fused_layers = fused
                kv = model.make_kv_cache(1, 64)
                h = model.forward(prompt, torch.arange(20), SeqBatch([0], [0], [20]), kv)
                logits[isa, fused] = model.compute_logits(h)
        # the unfused AVX2 forward's linears (the first ones recorded), replayed on the twins
        calls = rec.calls[: len(model.linears())]
        assert len(calls) == len(model.linears())
        for x, w, bias, y in calls:
            assert torch.equal(ops.linear(x, w, bias), y), w
    finally:
        K.set_native_isa("auto")
    for isa in ("avx2", "portable"):
        assert torch.equal(logits[isa, True], logits[isa, False]), isa
    a, b = logits["avx2", False], logits["portable", False]
    assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


def test_auto_takes_int8_for_k_quants_that_float_activations_run_slowly(mk, tmp_path, monkeypatch):
    # gemma3-270m's Q4_K_M file is mostly Q8_0 (q|k|v, gate|up, the 262k-row output layer) with
    # K-quant o and down. On AVX2 the 8-bit kernels do not speed Q8_0 up, so "auto" weighed the
    # bytes and took float32, after loading the K-quants for 8-bit activations; float activations
    # then ran them on the scalar twins: 109 ms a token (int8: 15-20 ms).
    from specdec import LLM, SamplingParams
    from specdec.model import llama

    def types(name: str) -> GT:
        if ".attn_output." in name:
            return GGML["q4_k"]
        if ".ffn_down." in name:
            return GGML["q6_k"]
        return GT.Q8_0

    path = mk.write_gguf(
        tmp_path / "tiny-mostly-q8.gguf", mk.SHAPES["tiny"], "F32", 0, types=types,
        quantize=lambda rows, t: gguf.quants.quantize(rows, t) if t == GT.Q8_0 else quantize(rows, t.name.lower()),
    )  # fmt: skip
    # NOTE: the AVX2 answers wherever the suite runs (with AVX-512 VNNI Q8_0 pays and K-quants
    # have vector float kernels)
    monkeypatch.setattr(K, "kquant_float_fast", lambda: False)
    monkeypatch.setattr(llama, "kquant_float_fast", lambda: False)
    monkeypatch.setattr(llama, "int8_activations_pay", lambda q: q in ("q4_0", "q4_1") or "_k" in q)
    auto = LLM(str(path), max_model_len=128)
    model = auto.engine.model
    assert not (model.activation_dtype == "float32" and model.slow_float_kquants())
    if not K.kquant_int8_fast():  # no 8-bit K-quant kernels: loaded as Q8_0, float32 as before
        assert model.activation_dtype == "float32"
        return
    assert model.activation_dtype == "int8"
    assert any(lin.weight.is_kquant for lin in model.linears())
    fixed = LLM(str(path), max_model_len=128, activation_dtype="int8")
    prompts = ["a b c a b c a b", "Once upon a time"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    got, want = auto.generate(prompts, sp), fixed.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]


def test_a_k_quant_draft_keeps_8_bit_activations_under_a_float32_target(mk, tmp_path, monkeypatch):
    # Without vector kernels for K-quants with float activations (AVX2), switching a K-quant
    # draft to the target's float32 ran it on the scalar twins: a draft that slow never pays.
    from specdec import LLM, SamplingParams
    from specdec.model import llama

    monkeypatch.setattr(K, "kquant_float_fast", lambda: False)  # AVX2's answer, wherever
    monkeypatch.setattr(llama, "kquant_float_fast", lambda: False)
    path = write_kquant_gguf(mk, tmp_path / "tiny-Q4_K_M.gguf", "Q4_K_M")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), max_model_len=128, activation_dtype="float32", speculative_config=spec)
    target, draft = llm.engine.model, llm.engine.speculator.proposer.model
    assert target.activation_dtype == "float32" and not target.slow_float_kquants()
    if K.kquant_int8_fast():  # the draft's own choice: K-quants native, 8-bit activations
        assert draft.activation_dtype == "int8" and any(
            lin.weight.is_kquant for lin in draft.linears()
        )
    assert not (draft.activation_dtype == "float32" and draft.slow_float_kquants())
    plain = LLM(str(path), max_model_len=128, activation_dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["a b c a b c a b", "Once upon a time"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
