"""16-bit weights (f16 / bf16) stay 16-bit and run on native kernels (issue 18, item 6).

The kernels widen each weight exactly to float32 in registers, so a 16-bit weight must give bit for
bit what its float32 expansion gives on the same instruction set, for every row count (batch
invariance), and stay within float32 rounding of a float64 reference.  The loaders keep GGUF F16 /
BF16 tensors and Hugging Face float16 / bfloat16 safetensors 16-bit; models built from them match
the float32-expanded model exactly and transformers on the same weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from specdec import kernels as K
from specdec.kernels import get_ops
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.model.loader import load_checkpoint
from tests.fixtures.kernels import (
    BATCH_SIZES,
    _randn,
    _require_native,
)
from tests.fixtures.models import _hf_16bit

HALF = ("f16", "bf16")
TORCH_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16}


def _half(qtype: str, n: int, k: int, seed: int = 0) -> K.PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    return K.pack_weight(qtype, w.to(TORCH_DTYPE[qtype]), n, k)


def _tricky(qtype: str, n: int, k: int) -> torch.Tensor:
    """Values at the edges of the 16-bit formats: subnormals, the largest finite, signed zeros."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7))
    w[0] *= 1e-6 if qtype == "f16" else 1e-39  # subnormal halves / bfloat16s
    w[1, :4] = torch.tensor([65504.0 if qtype == "f16" else 3.0e38, -0.0, 0.0, -1.0])
    return w.to(TORCH_DTYPE[qtype])


@pytest.mark.parametrize("qtype", HALF)
def test_half_weights_decode_exactly(native, qtype):
    # The identity gives back each 16-bit value widened, bit for bit.
    w16 = _tricky(qtype, 13, 48)
    w = K.pack_weight(qtype, w16, 13, 48)
    assert w.data.dtype == TORCH_DTYPE[qtype] and w.nbytes == 13 * 48 * 2  # never widened
    y = native.linear(torch.eye(48), w)
    assert torch.equal(y, w16.float().T)
    assert torch.equal(w.dequantize(), w16.float())


@pytest.mark.parametrize("qtype", HALF)
@pytest.mark.parametrize("k", [100, 256, 2048])
def test_half_equals_f32_on_widened_weights(native, qtype, k):
    # Same arithmetic as the f32 kernel of the same ISA, in registers (few rows) or through a
    # widened block (many rows), with and without bias.
    n = 37 if k == 2048 else 70
    w = _half(qtype, n, k)
    wf = K.pack_weight("f32", w.dequantize().contiguous(), n, k)
    x = _randn(40, k)
    bias = _randn(n, seed=3)
    for m in (*BATCH_SIZES, 40):
        assert torch.equal(native.linear(x[:m], w), native.linear(x[:m], wf)), m
        assert torch.equal(native.linear(x[:m], w, bias), native.linear(x[:m], wf, bias)), m


@pytest.mark.parametrize("qtype", HALF)
def test_half_linear_accuracy(native, qtype):
    n, k = 70, 300
    w = _half(qtype, n, k)
    x = _randn(21, k)
    bias = _randn(n, seed=3)
    y = native.linear(x, w, bias)
    wd = w.dequantize().double()
    ref = x.double() @ wd.T + bias.double()
    scale = x.double().abs() @ wd.abs().T + 1e-30  # error bound scale of a float32 dot product
    assert ((y.double() - ref).abs() / scale).max().item() < 2e-6


@pytest.mark.parametrize("qtype", HALF)
def test_half_linear_batch_and_thread_invariant(native, qtype):
    n, k = 600, 272
    w = _half(qtype, n, k)
    x = _randn(40, k)
    single = torch.cat([native.linear(x[i : i + 1], w) for i in range(40)])
    for m in BATCH_SIZES:
        for off in {0, 40 - m, (40 - m) // 2}:
            assert torch.equal(native.linear(x[off : off + m], w), single[off : off + m]), (m, off)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear(x, w)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, single)


def test_half_pack_sources_concat_and_errors():
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((24, 64)).astype(np.float32)
    f16 = w32.astype(np.float16)
    bf16_bytes = gguf.quants.quantize(w32, GT.BF16)  # GGUF BF16: uint8 [rows, 2 * cols]
    bf16_ref = gguf.quants.dequantize(bf16_bytes, GT.BF16)
    f16.flags.writeable = False  # a read-only memory map, as GGUFReader gives
    p16 = K.pack_weight("f16", f16, 24, 64)
    assert p16.data.dtype == torch.float16 and p16.nbytes == f16.nbytes
    np.testing.assert_array_equal(p16.dequantize().numpy(), f16.astype(np.float32))
    pb = K.pack_weight("bf16", bf16_bytes, 24, 64)
    np.testing.assert_array_equal(pb.dequantize().numpy(), bf16_ref)
    bits = bf16_bytes.view(np.uint16)  # Hugging Face bfloat16, as uint16 bit patterns
    assert torch.equal(K.pack_weight("bf16", bits, 24, 64).data, pb.data)
    rows = torch.tensor([5, 0, 23, 5])
    np.testing.assert_array_equal(pb.dequantize_rows(rows).numpy(), bf16_ref[rows.numpy()])
    fused = K.concat_weights([pb, K.pack_weight("bf16", bits[:8], 8, 64)])
    assert (fused.qtype, fused.out_features, fused.data.dtype) == ("bf16", 32, torch.bfloat16)
    assert torch.equal(fused.dequantize()[24:], pb.dequantize()[:8])
    with pytest.raises(ValueError):
        K.pack_weight("bf16", f16, 24, 64)  # float16 values are not bfloat16 ones
    with pytest.raises(ValueError):
        K.pack_weight("f16", torch.zeros(24, 63, dtype=torch.float16), 24, 64)
    with pytest.raises(ValueError):
        K.concat_weights([p16, pb])


@pytest.mark.parametrize("qtype", HALF)
def test_torch_ops_agree_with_native_on_half(qtype):
    _require_native()
    w = _half(qtype, 40, 96)
    x = _randn(5, 96)
    ref = x.double() @ w.dequantize().double().T
    for ops in (get_ops("native"), get_ops("torch")):
        assert (ops.linear(x, w).double() - ref).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------
# Loading


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    kv = model.make_kv_cache(1, 256)
    h = model.forward(torch.tensor(ids), torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv)
    return model.compute_logits(h)


def _model(path, quantization: str) -> LlamaModel:
    ckpt = load_checkpoint(path)
    return LlamaModel(
        ckpt, get_ops("native"), torch.device("cpu"), torch.float32, quantization, 256
    )


def _weight_formats(model: LlamaModel) -> set[tuple[str, torch.dtype]]:
    return {(lin.weight.qtype, lin.weight.data.dtype) for lin in model.linears()}


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_gguf_16bit_stays_16bit_and_equals_f32_expansion(type_name, tmp_path, mk):
    _require_native()
    path = mk.write_gguf(tmp_path / f"tiny-{type_name}.gguf", mk.SHAPES["tiny"], type_name, seed=1)
    qtype = type_name.lower()
    half = _model(path, "auto")
    assert _weight_formats(half) == {(qtype, TORCH_DTYPE[qtype])}
    wide = _model(path, "fp32")  # the old load: every weight widened to float32
    assert _weight_formats(wide) == {("f32", torch.float32)}
    ids = [(i * 37 + 11) % 1000 for i in range(30)]
    assert torch.equal(_logits(half, ids), _logits(wide, ids))
    # the embedding rows are the file's values
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type)[[3, 500]]
    np.testing.assert_array_equal(half.embed(torch.tensor([3, 500])).numpy(), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_hf_16bit_folder_loads_without_expansion(dtype, fixture, tmp_path, request):
    import transformers

    _require_native()
    folder = _hf_16bit(request.getfixturevalue(fixture), tmp_path / "m", dtype)
    qtype = "bf16" if dtype == torch.bfloat16 else "f16"
    ckpt = load_checkpoint(folder)
    raw = ckpt.tensors["layers.0.q_proj"]
    assert raw.qtype == qtype and raw.data.itemsize == 2  # mapped from the file, not widened
    half = LlamaModel(ckpt, get_ops("native"), torch.device("cpu"), torch.float32, "auto", 256)
    assert _weight_formats(half) == {(qtype, dtype)}
    ids = [(i * 37 + 11) % 250 for i in range(40)]
    ours = _logits(half, ids)
    assert torch.equal(ours, _logits(_model(folder, "fp32"), ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def test_release_pages_keeps_data_readable(tmp_path, mk):
    path = mk.write_gguf(tmp_path / "tiny-F16.gguf", mk.SHAPES["tiny"], "F16", seed=1)
    ckpt = load_checkpoint(path)
    raw = ckpt.tensors["layers.1.down_proj"]
    before = np.array(raw.data)
    raw.populate_pages()
    raw.release_pages()  # the pages come back from the file
    np.testing.assert_array_equal(np.array(raw.data), before)
    q = ckpt.tensors["layers.0.q_proj"]  # rows permuted back on read
    q.release_pages()
    assert q.data.shape == (q.shape[0], q.shape[1])


def test_dtype_bfloat16_keeps_native_kernels_and_16bit_weights(tiny_llama, tmp_path):
    from specdec import LLM

    _require_native()
    folder = _hf_16bit(tiny_llama, tmp_path / "m", torch.bfloat16)
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=128)
    model = llm.engine.model
    assert model.ops.name == "native" and model.dtype == torch.float32
    assert _weight_formats(model) == {("bf16", torch.bfloat16)}
