"""The native forward's timeline (``_C.set_timeline`` / ``_C.timeline``) that
benchmarks/layer_timeline.py reads: off it records nothing; on, every layer of a forward marks its
start, its four products with their weights' bytes and its attention, in order, and the
benchmark's parser splits them back into layers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specdec.kernels import get_ops
from specdec.kernels.native import _C
from specdec.model.llama import LlamaModel, SeqBatch
from specdec.model.loader import load_checkpoint

ROOT = Path(__file__).resolve().parents[3]
LAYER, LINEAR, LINEAR_END, ATTENTION, ATTENTION_END = range(5)

pytestmark = pytest.mark.skipif(_C is None, reason="native kernels not built")


def _bench():
    spec = importlib.util.spec_from_file_location(
        "layer_timeline", ROOT / "benchmarks" / "layer_timeline.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _step(model: LlamaModel, n: int) -> None:
    kv = model.make_kv_cache(1, 64)
    ids = torch.arange(5, 5 + n)
    model.compute_logits(model.forward(ids, torch.arange(n), SeqBatch([0], [0], [n]), kv))


def test_timeline_marks_each_layer_in_order(tiny_llama) -> None:
    model = LlamaModel(
        load_checkpoint(tiny_llama),
        get_ops("native"),
        torch.device("cpu"),
        torch.float32,
        "fp32",
        64,
    )
    assert model.use_fused_layers
    _C.timeline()
    _step(model, 3)
    assert _C.timeline() == []  # off: nothing
    _C.set_timeline(True)
    try:
        _step(model, 3)
    finally:
        _C.set_timeline(False)
    marks = _C.timeline()
    kinds = [int(k) for k in marks[0::3]]
    times = marks[1::3]
    layers = len(model.layers)
    per_layer = [LAYER, LINEAR, LINEAR_END, ATTENTION, ATTENTION_END] + [LINEAR, LINEAR_END] * 3
    assert kinds == per_layer * layers + [LINEAR, LINEAR_END]  # then the output layer
    assert times == sorted(times)
    # each product marks its weights' bytes: the layer's four, then the output layer's
    linear_bytes = [b for k, b in zip(kinds, marks[2::3]) if k == LINEAR]
    assert all(b > 0 for b in linear_bytes)
    assert linear_bytes[:4] == linear_bytes[4:8]  # every layer the same shapes
    assert _C.timeline() == []  # taken: cleared

    parsed, outside = _bench().parse(marks)
    assert len(parsed) == layers and parsed[-1]["last"] and not any(p["last"] for p in parsed[:-1])
    assert all(
        len(p["linears"]) == 4 and p["span"] >= sum(t for t, _ in p["linears"]) for p in parsed
    )
    assert [b for _, b in parsed[0]["linears"]] == linear_bytes[:4]
    assert len(outside) == 1 and outside[0][1] == linear_bytes[-1]
