"""The states the runner hands to drafters: the fused native layer loop and the op-by-op path
give the same bits, and a row's states do not depend on what shares its batch."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM
from specdec.model.llama import HIDDEN_FINAL, SeqBatch

CAPTURE = (1, HIDDEN_FINAL, 3, 0)


def _capture(model, kv, seqs: list[list[int]], slots: list[int]) -> torch.Tensor:
    ids = [t for s in seqs for t in s]
    pos = [p for s in seqs for p in range(len(s))]
    batch = SeqBatch(slots, [0] * len(seqs), [len(s) for s in seqs])
    final, states = model.forward_capture(torch.tensor(ids), torch.tensor(pos), batch, kv, CAPTURE)
    H = model.cfg.hidden_size
    assert states.shape == (len(ids), H * len(CAPTURE))
    assert torch.equal(states[:, H : 2 * H], final)  # HIDDEN_FINAL is the final normed state
    return states


def test_fused_and_op_by_op_states_are_identical(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), max_model_len=128, kernels="native")
    model, kv = llm.engine.model, llm.engine.kv
    assert model.use_fused_layers
    seqs = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32]]
    slots = [kv.allocate() for _ in seqs]
    fused = _capture(model, kv, seqs, slots)
    model.use_fused_layers = False
    try:
        op_by_op = _capture(model, kv, seqs, slots)
    finally:
        model.use_fused_layers = True
    assert torch.equal(fused, op_by_op)
    alone = _capture(model, kv, seqs[1:2], slots[1:2])
    assert torch.equal(alone, fused[5:7])  # batch-invariant
    # layer 0's input is the embedding; the state entering layer 1 differs from it
    H = model.cfg.hidden_size
    assert torch.equal(fused[:5, 3 * H :], model.embed(torch.tensor(seqs[0])))
    assert not torch.equal(fused[:, :H], fused[:, 3 * H :])


def test_forward_layers_checks_its_arguments(tiny_llama) -> None:
    # the whole layer stack in one native call refuses what would read out of bounds
    llm = LLM(str(tiny_llama), max_model_len=128, kernels="native")
    model, kv = llm.engine.model, llm.engine.kv
    slot = kv.allocate()
    layers = model._fused_layers()
    n = len(layers)
    x = model.embed(torch.tensor([5, 6]))
    rot = next(iter(model._rotary.values()))
    pos = torch.tensor([0, 1])
    args = (x, [rot.cos[pos]], [rot.sin[pos]])
    cache = (kv.k, kv.v, [slot], [0], [2])
    out, got = model.ops.forward_layers(layers, *args, [0] * n, *cache, [n - 1, 0])
    assert out.shape == x.shape and torch.equal(got[1], x) and len(got) == 2
    # whole tables and the positions: the call copies each token's rows out, the same floats
    tables = (x, [rot.cos], [rot.sin])
    again, _ = model.ops.forward_layers(layers, *tables, [0] * n, *cache, [], positions=pos)
    assert torch.equal(again, out)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        far = torch.tensor([0, rot.cos.shape[0]])
        model.ops.forward_layers(layers, *tables, [0] * n, *cache, [], positions=far)
    with pytest.raises(RuntimeError, match="one per row of x"):
        model.ops.forward_layers(layers, *tables, [0] * n, *cache, [], positions=pos[:1])
    with pytest.raises(RuntimeError, match="capture index"):
        model.ops.forward_layers(layers, *args, [0] * n, *cache, [n])
    before = kv.k[:, slot].clone()
    other = (model.embed(torch.tensor([7, 8])), *args[1:])  # would write other keys
    with pytest.raises(RuntimeError, match="rope index"):  # only the last layer's is wrong
        model.ops.forward_layers(layers, *other, [0] * (n - 1) + [1], *cache, [])
    assert torch.equal(kv.k[:, slot], before)  # checked before any layer wrote its cache
    with pytest.raises(RuntimeError, match="one rope index per layer"):
        model.ops.forward_layers(layers, *args, [0] * (n - 1), *cache, [])
