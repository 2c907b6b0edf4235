"""bf16x2 activations: 16-bit weights on AMX-BF16 tiles (kernels_amx16.cpp, issue 18 item 7).

Each float32 activation is split into two bfloat16s (hi + lo) and dotted with the 16-bit weight
(a half weight split into two bfloat16s too, exactly) on the tile unit, summed in float32.  So
every output is within 2^-16 of each product (3 * 2^-16 for half weights) plus float32
summation of the float64 reference, and every row is bit-identical to the same row computed
alone, with any thread count (batch invariance), which keeps speculation exact.  On a CPU or build without AMX-BF16 the option is refused with an error
that says so (the tests check that instead).
"""

from __future__ import annotations

import pytest
import torch

from specdec import kernels as K
from specdec.config import ConfigError
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.model.loader import load_checkpoint
from tests.fixtures.kernels import _require_native, on_threads

HALF = ("f16", "bf16")
TORCH_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16}
AMX16 = K.amx16_available()


def _weight(qtype: str, n: int, k: int, seed: int = 0) -> K.PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    w = K.pack_weight(qtype, w.to(TORCH_DTYPE[qtype]), n, k)
    w.enable_x2()
    return w


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _bound(x: torch.Tensor, w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Error bound per output, times sum |x| |w|: each product's split error (2^-16 of it, 3 *
    2^-16 for half weights) plus float32 summation of up to 3K terms."""
    split = 2.0**-16 if qtype == "bf16" else 3 * 2.0**-16
    return (split + 3 * x.shape[1] * 2.0**-24) * (x.abs().double() @ w.abs().double().T)


def _refused() -> bool:
    """Without AMX-BF16 every bf16x2 call must be refused with an error that names it."""
    if AMX16:
        return False
    w = K.pack_weight("bf16", torch.randn(16, 32).bfloat16(), 16, 32)
    with pytest.raises(ValueError, match="AMX-BF16"):
        w.enable_x2()
    return True


@pytest.mark.parametrize("qtype", HALF)
@pytest.mark.parametrize(
    "n,k",
    [(16, 32), (48, 96), (70, 100), (130, 576), (64, 1100)],  # tails of N and K; several K chunks
)
def test_x2_linear_accuracy_and_batch_invariance(native, qtype, n, k):
    if _refused():
        return
    w = _weight(qtype, n, k)
    assert w.x2 and w.qtype_code in (11, 12)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    x = _x(40, k)  # 3 activation groups: the chunk path; 1-2 groups: the streaming path
    y = native.linear(x, w, bias)
    ref = x.double() @ w.data.double().T + bias.double()
    assert ((y.double() - ref).abs() <= _bound(x, w.data.float(), qtype) + 1e-6).all()
    for rows in (1, 2, 5, 16, 17, 33):
        assert torch.equal(native.linear(x[:rows], w, bias), y[:rows]), rows
    assert torch.equal(native.linear(x[7:8], w, bias)[0], y[7])
    # not the float path: that one gives the float32 expansion's bits
    w.disable_x2()
    assert not torch.equal(native.linear(x, w, bias), y)


@pytest.mark.parametrize("qtype", HALF)
def test_x2_many_rows_and_threads(native, qtype):
    if _refused():
        return
    w = _weight(qtype, 96, 256, seed=5)
    x = _x(300, 256)  # more than one pass of 256 activation rows
    one = on_threads(1, native.linear, x, w)
    assert torch.equal(one, on_threads(2, native.linear, x, w))
    assert torch.equal(native.linear(x[290:], w), one[290:])
    assert (
        (one.double() - x.double() @ w.data.double().T).abs() <= _bound(x, w.data.float(), qtype)
    ).all()


def test_x2_half_weights_are_exact_in_the_split(native):
    if _refused():
        return
    # Half weights of 11 significant bits (subnormal, large, signed zero) split exactly into
    # two bfloat16s: against exactly representable activations (powers of two) the result is exact.
    w16 = torch.randn(16, 64, generator=torch.Generator().manual_seed(9))
    w16[0] *= 1e-6
    w16[1, :3] = torch.tensor([65504.0, -0.0, 0.0])
    w16 = w16.half()
    w = K.pack_weight("f16", w16, 16, 64)
    w.enable_x2()
    y = native.linear(torch.eye(64), w)
    assert torch.equal(y, w16.float().T)


@pytest.mark.parametrize("qtype", HALF)
def test_x2_tiles_replace_the_rows_and_give_them_back(native, qtype):
    if _refused():
        return
    w16 = (torch.randn(70, 100, generator=torch.Generator().manual_seed(4)) * 0.1).to(
        TORCH_DTYPE[qtype]
    )  # tails: 70 rows, 100 inputs
    w = K.pack_weight(qtype, w16, 70, 100)
    w.enable_x2()
    assert w.x2 and not w.holds_blocks  # stored once: the tiles replace the rows
    assert w.nbytes == 80 * 128 * 2  # padded to 16 rows and 32 inputs
    assert torch.equal(w.data, w16)  # given back exactly
    rows = torch.tensor([69, 0, 17, 17])
    assert torch.equal(w.dequantize_rows(rows), w16[rows].float())
    w.disable_x2()
    assert not w.x2 and w.holds_blocks and torch.equal(w.data, w16)


def _tiny(path, activation_dtype: str) -> LlamaModel:
    return LlamaModel(
        load_checkpoint(path), K.get_ops("native"), torch.device("cpu"), torch.float32, "auto",
        256, activation_dtype,
    )  # fmt: skip


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    kv = model.make_kv_cache(1, 256)
    h = model.forward(torch.tensor(ids), torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv)
    return model.compute_logits(h)


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_x2_model_close_to_float_and_speculation_exact(type_name, tmp_path, mk):
    from specdec import LLM, SamplingParams

    _require_native()
    path = mk.write_gguf(tmp_path / f"tiny-{type_name}.gguf", mk.SHAPES["tiny"], type_name, seed=1)
    if not AMX16:
        with pytest.raises(ConfigError, match="AMX-BF16"):
            _tiny(path, "bf16x2")
        return
    x2 = _tiny(path, "bf16x2")
    assert x2.activation_dtype == "bf16x2" and all(lin.weight.x2 for lin in x2.linears())
    ids = [(i * 37 + 11) % 1000 for i in range(30)]
    a, b = _logits(x2, ids), _logits(_tiny(path, "float32"), ids)
    assert not torch.equal(a, b)
    assert (a - b).abs().max().item() < 1e-3 * max(1.0, b.abs().max().item())
    x2.set_activation_dtype("float32")  # and back: the float kernels' bits again
    assert not any(lin.weight.x2 for lin in x2.linears())
    assert torch.equal(_logits(x2, ids), b)
    # greedy speculation under bf16x2 gives plain decoding's tokens
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(path), activation_dtype="bf16x2", max_model_len=128)
    ref = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    spec = LLM(
        str(path), activation_dtype="bf16x2", max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )  # fmt: skip
    assert spec.engine.model.activation_dtype == "bf16x2"
    assert spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_auto_takes_bf16x2_for_bfloat16_weights_only(type_name, tmp_path, mk):
    # bfloat16 weights decode about as fast on the tiles and prefill ~3x faster; float16 ones
    # decode slower there (their split), so auto keeps them on the float kernels.
    _require_native()
    path = mk.write_gguf(tmp_path / f"tiny-{type_name}.gguf", mk.SHAPES["tiny"], type_name, seed=1)
    model = _tiny(path, "auto")
    want = "bf16x2" if AMX16 and type_name == "BF16" else "float32"
    assert model.activation_dtype == want
    assert [lin.weight.x2 for lin in model.linears()] == [want == "bf16x2"] * len(model.linears())


def test_bf16x2_refused_for_quantized_weights(tmp_path, mk):
    _require_native()
    path = mk.write_gguf(tmp_path / "tiny-Q8_0.gguf", mk.SHAPES["tiny"], "Q8_0", seed=1)
    with pytest.raises(ConfigError, match="bf16x2 needs f16/bf16 weights"):
        _tiny(path, "bf16x2")
    w = K.quantize_weight(torch.randn(16, 32), "q8_0")
    assert not w.x2_eligible()
    with pytest.raises(ValueError, match="bf16x2"):
        w.enable_x2()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_auto_on_a_hf_bf16_folder_matches_transformers(fixture, tmp_path, request):
    # The usual Hugging Face case: a bfloat16 folder, default settings.  On AMX-BF16 CPUs it
    # runs bf16x2 and its logits still match transformers' float32 on the same weights.
    import transformers

    from tests.fixtures.models import _hf_16bit

    _require_native()
    folder = _hf_16bit(request.getfixturevalue(fixture), tmp_path / "m", torch.bfloat16)
    model = _tiny(folder, "auto")
    assert model.activation_dtype == ("bf16x2" if AMX16 else "float32")
    ids = [(i * 37 + 11) % 250 for i in range(40)]
    ours = _logits(model, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def test_a_quantized_draft_under_a_bf16x2_target(tmp_path, mk):
    # The target's explicit bf16x2 does not apply to a Q8_0 draft model: the draft keeps its own
    # automatic choice instead of failing, and the output is still plain decoding's.
    from specdec import LLM, SamplingParams

    _require_native()
    target = mk.write_gguf(tmp_path / "t-BF16.gguf", mk.SHAPES["tiny"], "BF16", seed=1)
    draft = mk.write_gguf(tmp_path / "d-Q8_0.gguf", mk.SHAPES["tiny"], "Q8_0", seed=1)
    act = "bf16x2" if AMX16 else "float32"
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), activation_dtype=act, max_model_len=128)
    ref = plain.generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(
        str(target), activation_dtype=act, max_model_len=128,
        speculative_config={"model": str(draft), "num_speculative_tokens": 3},
    )  # fmt: skip
    assert spec.engine.model.activation_dtype == act
    assert spec.engine.speculator.proposer.model.activation_dtype in ("int8", "float32")
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == ref
