"""Our forward against transformers on tiny random models; incremental decoding and rollback."""

from __future__ import annotations

import pytest
import torch

from specdec import kernels
from specdec.kernels import get_ops
from specdec.kv_cache.pool import standard_keys
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.model.loader import load_checkpoint
from tests.fixtures.kernels import _isas


def _ours(folder, kernels: str = "auto") -> LlamaModel:
    return LlamaModel(
        load_checkpoint(folder), get_ops(kernels), torch.device("cpu"), torch.float32, "fp32", 256
    )


def _hf_logits(folder, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _full(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    kv = model.make_kv_cache(1, 256)
    h = model.forward(torch.tensor(ids), torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv)
    return model.compute_logits(h)


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama", "tiny_gemma", "tiny_qwen2", "tiny_qwen3",
        "tiny_qwen3_moe", "tiny_mixtral", "tiny_qwen2_moe",
    ],
)  # fmt: skip
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_logits_match_transformers(fixture: str, kernels: str, request) -> None:
    folder = request.getfixturevalue(fixture)
    ids = [(i * 37 + 11) % 250 for i in range(40)]  # longer than Gemma's tiny sliding window
    ours = _full(_ours(folder, kernels), ids)
    ref = _hf_logits(folder, ids)
    assert (ours - ref).abs().max().item() < 1e-3


def test_incremental_decoding_and_rollback_match_full_forward(tiny_llama) -> None:
    model = _ours(tiny_llama)
    ids = [(i * 13 + 5) % 250 for i in range(30)]
    full = _full(model, ids)
    kv = model.make_kv_cache(2, 256)
    pieces = [12, 1, 1, 3, 5, 1, 7]  # prefill, then one and several at a time
    start = 0
    got = []
    for n in pieces:
        h = model.forward(
            torch.tensor(ids[start : start + n]),
            torch.arange(start, start + n),
            SeqBatch([1], [start], [n]),
            kv,
        )
        got.append(model.compute_logits(h))
        start += n
    got = torch.cat(got)
    assert torch.equal(got, full[: len(got)])  # native kernels are batch-invariant: bit-exact
    # Roll back 6 positions (write garbage there first), then re-forward: same as never having gone.
    junk = torch.tensor([7] * 6)
    model.forward(junk, torch.arange(start, start + 6), SeqBatch([1], [start], [6]), kv)
    back = start - 6
    h = model.forward(
        torch.tensor(ids[back:30]), torch.arange(back, 30), SeqBatch([1], [back], [30 - back]), kv
    )
    assert torch.equal(model.compute_logits(h), full[back:30])


def test_batched_sequences_equal_single(tiny_gemma) -> None:
    model = _ours(tiny_gemma)
    a = [(i * 7 + 1) % 250 for i in range(25)]
    b = [(i * 11 + 3) % 250 for i in range(9)]
    kv = model.make_kv_cache(3, 256)
    h = model.forward(
        torch.tensor(a + b),
        torch.tensor(list(range(25)) + list(range(9))),
        SeqBatch([2, 0], [0, 0], [25, 9]),
        kv,
    )
    both = model.compute_logits(h)
    assert torch.equal(both[:25], _full(model, a))
    assert torch.equal(both[25:], _full(model, b))


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama",
        "tiny_gemma",
        "tiny_qwen2",
        "tiny_qwen3",
        "tiny_qwen3_moe",  # mixture of experts (kernels/csrc/moe.cpp)
        "tiny_mixtral",
        "tiny_qwen2_moe",  # with a shared expert
    ],
)
@pytest.mark.parametrize(
    "quantization,activations,kv_dtype",
    [
        ("fp32", "float32", "auto"),
        ("q4_1", "float32", "auto"),
        ("q4_1", "int8", "auto"),
        ("q8_0", "int8", "auto"),
        ("fp32", "float32", "float16"),
        ("q4_1", "int8", "float16"),
    ],
)
def test_fused_native_layers_equal_python_layers(
    fixture: str, quantization: str, activations: str, kv_dtype: str, request
) -> None:
    # One native call per layer (kernels/csrc/layer.cpp) must compute exactly what the op-by-op
    # Python layer computes: same logits and same KV cache, bit for bit, over a prefill longer
    # than Gemma's tiny sliding window, a step that batches two sequences and a one-row step
    # (a mixture of experts groups the rows of a step by expert, and runs one row's one by one).
    folder = request.getfixturevalue(fixture)
    model = LlamaModel(
        load_checkpoint(folder), get_ops("native"), torch.device("cpu"), torch.float32,
        quantization, 256, activations,
    )  # fmt: skip
    model.set_kv_dtype(kv_dtype)  # float16: keys and values rounded once, the same way
    assert model.use_fused_layers
    assert model.activation_dtype == activations
    if activations == "int8":
        assert model.layers[0].qkv.weight.a8 is not None
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 250, (40,), generator=gen)
    step_ids = torch.randint(0, 250, (5,), generator=gen)
    results = []
    for fused in (False, True):
        model.use_fused_layers = fused
        kv = model.make_kv_cache(3, 256)
        h1 = model.forward(prompt, torch.arange(40), SeqBatch([2], [0], [40]), kv)
        pos = torch.tensor([40, 41, 0, 1, 2])
        h2 = model.forward(step_ids, pos, SeqBatch([2, 0], [40, 0], [2, 3]), kv)
        routes = [lw.moe.last_ids for lw in model.layers if lw.moe is not None]
        h3 = model.forward(step_ids[:1], pos[2:3] + 3, SeqBatch([0], [3], [1]), kv)
        logits = torch.cat([model.compute_logits(h) for h in (h1, h2, h3)])
        keys = standard_keys(kv.k, kv.max_len, kv.key_block)  # [L, S, Hkv, max_len, D]
        results.append((logits, keys[:, [0, 2], :, :42].clone(), kv.v[:, [0, 2], :, :42].clone()))
        results[-1] += (routes,)
    (la, ka, va, ra), (lb, kb, vb, rb) = results
    assert torch.equal(la, lb)
    assert len(ra) == len(rb) and all(torch.equal(a, b) for a, b in zip(ra, rb))
    if "moe" in fixture or "mixtral" in fixture:
        assert ra and all(r.shape[0] == 5 for r in ra)  # the 5-row step's experts, per layer
    assert torch.equal(ka[:, 0, :, :4], kb[:, 0, :, :4]) and torch.equal(ka[:, 1], kb[:, 1])
    assert torch.equal(va[:, 0, :, :4], vb[:, 0, :, :4]) and torch.equal(va[:, 1], vb[:, 1])


def test_fused_layer_rejects_inconsistent_batches(tiny_llama) -> None:
    model = _ours(tiny_llama, "native")
    layer = model._fused_layers()[0]
    kv = model.make_kv_cache(2, 256)
    x = torch.zeros(3, model.cfg.hidden_size)
    rot = model._rotary[model.cfg.layer_rope_theta(0)]
    cos, sin = rot.cos[:3], rot.sin[:3]
    with pytest.raises(RuntimeError, match="counts sum to 2"):
        layer.forward(x, cos, sin, kv.k[0], kv.v[0], [0], [0], [2])
    with pytest.raises(RuntimeError, match="slot out of range"):
        layer.forward(x, cos, sin, kv.k[0], kv.v[0], [5], [0], [3])
    with pytest.raises(RuntimeError, match="positions beyond the cache"):
        layer.forward(x, cos, sin, kv.k[0], kv.v[0], [0], [255], [3])


def test_activation_dtype_choice_and_errors(tiny_llama) -> None:
    ckpt = load_checkpoint(tiny_llama)
    cpu = torch.device("cpu")
    fp32 = LlamaModel(ckpt, get_ops("native"), cpu, torch.float32, "fp32", 64, "auto")
    assert fp32.activation_dtype == "float32"  # float weights: nothing to run in int8
    with pytest.raises(ValueError, match="quantized weights"):
        fp32.set_activation_dtype("int8")
    with pytest.raises(ValueError, match="activation_dtype must be one of"):
        fp32.set_activation_dtype("int4")
    q = LlamaModel(ckpt, get_ops("native"), cpu, torch.float32, "q8_0", 64, "auto")
    assert q.activation_dtype == ("int8" if kernels.int8_activations_pay("q8_0") else "float32")
    # 4-bit weights: int8 wherever the 8-bit kernels run natively (VNNI or AVX2)
    q4 = LlamaModel(ckpt, get_ops("native"), cpu, torch.float32, "q4_1", 64, "auto")
    assert q4.activation_dtype == ("int8" if kernels.int8_activations_fast() else "float32")
    assert kernels.int8_activations_pay("q4_1") == kernels.int8_activations_fast()
    torch_q = LlamaModel(ckpt, get_ops("torch"), cpu, torch.float32, "q8_0", 64, "auto")
    assert torch_q.activation_dtype == "float32"
    q.set_activation_dtype("int8")
    ids = torch.arange(1, 21)
    kv = q.make_kv_cache(1, 64)
    a = q.compute_logits(q.forward(ids, torch.arange(20), SeqBatch([0], [0], [20]), kv))
    q.set_activation_dtype("float32")
    assert all(lin.weight.a8 is None for lin in q.linears())
    b = q.compute_logits(q.forward(ids, torch.arange(20), SeqBatch([0], [0], [20]), kv))
    assert not torch.equal(a, b) and (a - b).abs().max().item() < 0.1 * b.abs().max().item()


@pytest.mark.parametrize("intermediate", [56, 100])
def test_fused_silu_of_any_width_equals_python_layers(intermediate: int, tmp_path) -> None:
    # The native layer's SiLU (layer.cpp silu_mul_row) does ATen's vector steps over each row's
    # whole steps of two vectors and ATen's scalar step over the rest: widths that leave a rest
    # on 16 and on 8 lanes (56 = 32 + 24 = 48 + 8; 100 = 96 + 4 = 96 + 4), bit for bit against
    # the Python layer (F.silu), for a prefill and one-row steps.
    from tests.fixtures.models import make_tiny_model

    folder = make_tiny_model(
        tmp_path / "m", "llama", seed=5, num_layers=2, intermediate_size=intermediate
    )
    model = LlamaModel(
        load_checkpoint(folder), get_ops("native"), torch.device("cpu"), torch.float32, "fp32", 64
    )
    assert model.use_fused_layers and model.cfg.intermediate_size == intermediate
    ids = torch.randint(0, 250, (20,), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        model.use_fused_layers = fused
        kv = model.make_kv_cache(1, 64)
        h1 = model.forward(ids[:17], torch.arange(17), SeqBatch([0], [0], [17]), kv)
        h2 = model.forward(ids[17:18], torch.tensor([17]), SeqBatch([0], [17], [1]), kv)
        h3 = model.forward(ids[18:], torch.tensor([18, 19]), SeqBatch([0], [18], [2]), kv)
        results.append(torch.cat([model.compute_logits(h) for h in (h1, h2, h3)]))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("isa", _isas())
def test_fused_cache_writes_equal_python_layers_on_each_isa(isa: str, kv_dtype: str, tmp_path):
    # What the native layer writes each token (the rotated queries, the keys and values in the
    # cache's format) comes from the kernel table's vector forms where it has them (kernels.h
    # rope_head ... q8_head), else from layer.cpp's own loops (the portable table): on every
    # table the same bits as the Python layer's torch ops (KVCache.store). Head size 20: a run
    # of 8 lanes and a rest in each half of the rotation and in each head's 8-bit entries.
    from tests.fixtures.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "llama", seed=7, hidden_size=80)
    model = LlamaModel(
        load_checkpoint(folder), get_ops("native"), torch.device("cpu"), torch.float32, "fp32", 64
    )
    model.set_kv_dtype(kv_dtype)
    assert model.use_fused_layers and model.cfg.head_dim == 20
    ids = torch.randint(0, 250, (24,), generator=torch.Generator().manual_seed(2))
    kernels.set_native_isa(isa)
    try:
        results = []
        for fused in (False, True):
            model.use_fused_layers = fused
            kv = model.make_kv_cache(2, 64)
            h1 = model.forward(ids[:19], torch.arange(19), SeqBatch([1], [0], [19]), kv)
            pos = torch.tensor([19, 0, 1, 2])
            h2 = model.forward(ids[19:23], pos, SeqBatch([1, 0], [19, 0], [1, 3]), kv)
            logits = torch.cat([model.compute_logits(h) for h in (h1, h2)])
            results.append((logits, kv.k.clone(), kv.v.clone()))
    finally:
        kernels.set_native_isa("auto")
    (la, ka, va), (lb, kb, vb) = results
    assert torch.equal(la, lb) and torch.equal(ka, kb) and torch.equal(va, vb)
    assert ka.abs().sum() > 0 and va.abs().sum() > 0
