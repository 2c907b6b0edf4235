"""Fixed-shape forwards (worker/static_runner.py), the GPU path: on the CPU with the torch kernels
here, and on CUDA as well where a GPU is present (tests marked ``cuda``; scripts/gpu-check.sh)."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.loading import load_model
from specdec.model.llama import SeqBatch
from specdec.spec_decode import METHODS
from specdec.worker.static_runner import MIN_SPAN, StaticForward, StaticModelRunner
from tests.fixtures.heads import method_cases
from tests.fixtures.models import make_tiny_model
from tests.fixtures.prompts import PROMPTS

DEVICES = ["cpu"] + (
    [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []
)


def _static(folder, device: str, num_slots: int = 3, dtype=torch.float32) -> StaticForward:
    model, _ = load_model(str(folder), torch.device(device), dtype, "torch", "auto", 256)
    kv = model.make_kv_cache(num_slots, 256 + 128)
    return StaticForward(model, kv, (), use_graphs=device == "cuda")


def _eager_logits(static: StaticForward, ids: list[int]) -> torch.Tensor:  # [n, V]
    model = static.model
    kv = model.make_kv_cache(1, 256)
    n = len(ids)
    dev = model.device
    hidden = model.forward(
        torch.tensor(ids, device=dev), torch.arange(n, device=dev), SeqBatch([0], [0], [n]), kv
    )
    return model.compute_logits(hidden)


IDS = [(i * 37 + 11) % 250 for i in range(40)]


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_and_steps_compute_the_model(tiny_llama, device) -> None:
    """A prompt prefilled in pieces, then its tokens fed as steps, gives the eager model's
    logits (float32)."""
    static = _static(tiny_llama, device)
    final, _ = static.prefill(1, 0, IDS[:30])
    got = [static.logits(final)]
    for start in (30, 35):  # two steps of 5 tokens at slot 1
        _, logits, _ = static.step([(1, start, IDS[start : start + 5])])
        got.append(logits[static.rows : static.rows + 5].clone())
    want = _eager_logits(static, IDS)
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["tiny_gemma", "tiny_qwen3", "tiny_qwen2"])
def test_other_architectures_at_fixed_shapes(arch, device, request) -> None:
    """Gemma 3 (sliding windows, scaled embeddings, q/k norms), Qwen3 (q/k norms) and Qwen2 (qkv
    biases): prefill pieces and steps give the eager model's logits."""
    static = _static(request.getfixturevalue(arch), device)
    ids = IDS + IDS[:10]  # past Gemma's 16-token window
    final, _ = static.prefill(0, 0, ids[:43])
    got = [static.logits(final)]
    _, logits, _ = static.step([(0, 43, ids[43:])])
    got.append(logits[: len(ids) - 43].clone())
    torch.testing.assert_close(torch.cat(got), _eager_logits(static, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_result_is_independent_of_the_step(tiny_llama, device) -> None:
    """The same request's rows, alone in a step and beside two others: bit-identical, and a
    prompt prefilled in one call or split anywhere: bit-identical. (Plain decoding and
    verification then compute the same bits: speculation is exact.)"""
    runs = []
    for others in (False, True):
        static = _static(tiny_llama, device)
        static.prefill(0, 0, IDS[:20])
        if others:
            static.prefill(1, 0, IDS[5:17])
            static.prefill(2, 0, IDS[9:12])
        reqs = [(0, 20, IDS[20:23])]
        if others:
            reqs += [(1, 12, IDS[30:38]), (2, 3, IDS[1:2])]
        _, logits, _ = static.step(reqs)
        runs.append(logits[:3].clone())
    assert torch.equal(runs[0], runs[1])
    whole = _static(tiny_llama, device)
    split = _static(tiny_llama, device)
    a, _ = whole.prefill(0, 0, IDS)
    b1, _ = split.prefill(0, 0, IDS[:7])
    b2, _ = split.prefill(0, 7, IDS[7:])
    assert torch.equal(a, torch.cat([b1, b2]))


@pytest.mark.parametrize("device", DEVICES)
def test_the_attention_span_changes_no_bit(tiny_llama, device) -> None:
    """Masked keys add exact zeros: a row attends alike over 256 or 1,024 positions (steps
    switch spans as contexts grow; plain and speculative runs switch at different steps). On
    the CPU, where torch's attention does not keep that, a step spans the whole slot."""
    static = _static(tiny_llama, device)
    assert static.spans == (device == "cuda")
    if not static.spans:
        assert static.span_for(0) == static.span_for(200) == static.kv.max_len
        return
    cfg = static.model.shard_cfg
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3 * static.rows, cfg.num_heads, cfg.head_dim, generator=gen)
    keys = torch.randn(3, cfg.num_kv_heads, 4 * MIN_SPAN, cfg.head_dim, generator=gen)
    values = torch.randn(keys.shape, generator=gen)
    pos = torch.randint(0, MIN_SPAN, (3, static.rows), generator=gen)
    q, keys, values, pos = (t.to(device) for t in (q, keys, values, pos))
    outs = []
    for span in (MIN_SPAN, 4 * MIN_SPAN):
        mask = static._masks(pos, span)[0]
        outs.append(static._attention(q, keys[:, :, :span], values[:, :, :span], mask, 3))
    assert torch.equal(outs[0], outs[1])


def test_every_span_is_known_before_serving(tiny_llama) -> None:
    """Graphs are captured at start-up for every span a step can take (none while serving)."""
    model, _ = load_model(str(tiny_llama), torch.device("cpu"), torch.float32, "torch", "auto", 512)
    static = StaticForward(model, model.make_kv_cache(2, 512 + 128), (), use_graphs=False)
    assert static.all_spans() == [640]  # spans off (the CPU): the whole slot
    static.spans = True  # as on CUDA
    spans = static.all_spans()
    assert spans == [256, 512]
    assert all(static.span_for(p) in spans for p in range(static.max_pos))


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_leave_other_slots_alone(tiny_llama, device) -> None:
    static = _static(tiny_llama, device)
    static.prefill(1, 0, IDS[:10])
    static.prefill(2, 0, IDS[:10])
    before = static.kv.k[:, :, :, : static.max_pos].clone(), static.kv.v[:, :, :, :256].clone()
    static.step([(0, 0, IDS[:2])])
    assert torch.equal(before[0][:, 1:], static.kv.k[:, 1:, :, : static.max_pos])
    assert torch.equal(before[1][:, 1:], static.kv.v[:, 1:, :, :256])


# ---- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cases(tiny_llama, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    tmp = tmp_path_factory.mktemp("static_heads")
    draft = make_tiny_model(tmp / "draft", "llama", seed=5, num_layers=1)
    return method_cases(tiny_llama, draft, tmp, suffix_k=None)  # suffix asks 32: 7 a step here


def _generate(target: str, spec: dict | None, params: list, device: str) -> tuple[list, LLM]:
    llm = LLM(
        target, speculative_config=spec, max_model_len=256, max_num_seqs=3,
        max_num_batched_tokens=24, kernels="torch", device=device, static_shapes=True,
        dtype="bfloat16" if device == "cuda" else "float32",
    )  # fmt: skip
    assert isinstance(llm.engine.runner, StaticModelRunner)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], llm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_exact_at_fixed_shapes(method, device, cases) -> None:
    """Greedy and seeded output of each drafter equals plain decoding, three requests at a time
    with prompts chunked beside decoding rows."""
    assert method in cases, f"method {method!r} has no case"
    target, spec = cases[method]
    greedy = [
        SamplingParams(temperature=0, max_tokens=16 + 3 * i, ignore_eos=True) for i in range(8)
    ]
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=16, ignore_eos=True)
        for i in range(8)
    ]
    for params in (greedy, seeded):
        ids, llm = _generate(target, spec | {"adaptive": False}, params, device)
        assert llm.engine.spec_stats.num_draft_tokens > 0
        assert llm.engine.speculator.max_k <= llm.engine.step_rows - 1
        assert ids == _generate(target, None, params, device)[0]


def test_device_auto_is_the_gpu_where_there_is_one() -> None:
    from specdec.config import ConfigError, EngineConfig

    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig(model="m", device="auto").device == want
    assert EngineConfig(model="m", device="cpu").device == "cpu"
    if torch.cuda.is_available():
        assert EngineConfig(model="m", device="cuda").device == "cuda"
    else:  # a clear one-line error, not torch's assertion deep inside the load
        with pytest.raises(ConfigError, match="device cuda: torch sees no CUDA GPU"):
            EngineConfig(model="m", device="cuda")
