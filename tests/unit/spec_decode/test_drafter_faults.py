"""A drafter that fails never fails a request (issue 30): one that raises when proposing is
switched off for that request and plain decoding goes on (the same output), counted in the
metrics; a fault in its add / remove hooks leaves no ``Request`` behind in the engine."""

from __future__ import annotations

import gc
import logging
import types

import pytest

from specdec import LLM
from specdec.engine.speculator import DrafterError
from specdec.metrics import EngineMetrics
from specdec.sampling_params import SamplingParams as SP

PROMPTS = ["the cat sat on the mat", "a b c a b c a b", "Once upon a time", "hello there"]
BAD_SEED = 666


def _llm(path, spec: dict | None = None) -> LLM:
    return LLM(str(path), speculative_config=spec, max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=64)  # fmt: skip


def _params(temperature: float = 0.0, bad: int | None = None) -> list[SP]:
    return [
        SP(temperature=temperature, max_tokens=24, ignore_eos=True, seed=BAD_SEED if i == bad else i)
        for i in range(len(PROMPTS))
    ]  # fmt: skip


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return _llm(tiny_llama)


def _spec(method: str, tiny_draft) -> dict:
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(tiny_draft)
    return spec


def _check_forgotten(llm: LLM) -> None:
    """Nothing of any request is left in the engine, the speculator or the drafter."""
    engine, spec = llm.engine, llm.engine.speculator
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.kv.num_used_slots == 0
    assert not spec._drafter_off and not spec._shadow and not spec._hidden
    proposer = spec.proposer
    for name in ("indexes", "_requests", "states", "last_drafts", "last_scores"):
        assert not getattr(proposer, name, None), name
    if hasattr(proposer, "kv"):
        assert proposer.kv.num_used_slots == 0


def _outside_frames(obj: object, *also: object) -> list[object]:
    """What refers to ``obj`` besides running frames (the test's locals) and ``also``."""
    gc.collect()
    return [
        r
        for r in gc.get_referrers(obj)
        if not isinstance(r, types.FrameType) and all(r is not a for a in also)
    ]


# ---- a drafter that raises when proposing -------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_drafter_raising_on_every_call_falls_back_to_plain(
    tiny_llama, tiny_draft, plain, monkeypatch, caplog, method: str, temperature: float
) -> None:
    llm = _llm(tiny_llama, _spec(method, tiny_draft))
    want = _ids(plain.generate(PROMPTS, _params(temperature)))
    calls = []

    def broken(inp):
        calls.append(len(inp.requests))
        raise RuntimeError("injected drafter failure: 'some client text'\nline two")

    monkeypatch.setattr(llm.engine.speculator.proposer, "propose", broken)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        outs = llm.generate(PROMPTS, _params(temperature))
    assert _ids(outs) == want
    assert all(o.error is None and o.spec_decode_stats.num_drafts == 0 for o in outs)
    engine = llm.engine
    assert engine.num_drafter_failures == len(PROMPTS) and engine.num_failed_requests == 0
    # switched off after its first failure: one batched call, then one call per request
    assert calls == [len(PROMPTS)] + [1] * len(PROMPTS)
    lines = [r.getMessage() for r in caplog.records if "drafter" in r.getMessage()]
    assert len(lines) == len(PROMPTS)
    for line in lines:  # one line, the exception's type, not its message, no traceback
        assert "RuntimeError" in line and "client text" not in line and "\n" not in line
    assert all(r.exc_info is None for r in caplog.records)
    _check_forgotten(llm)
    metrics = EngineMetrics("tiny")
    metrics.update(engine)
    text = metrics.render().decode()
    assert 'specdec:spec_decode_num_drafter_failures_total{model_name="tiny"} 4.0' in text
    # the switch is per request: the next call drafts again (and fails again, alone)
    monkeypatch.undo()
    again = llm.generate(PROMPTS, _params(temperature))
    assert _ids(again) == want and engine.num_drafter_failures == len(PROMPTS)
    assert sum(o.spec_decode_stats.num_drafts for o in again) > 0


def test_drafter_raising_for_one_request_switches_off_that_one(tiny_llama, plain, monkeypatch):
    llm = _llm(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    want = _ids(plain.generate(PROMPTS, _params(bad=1)))
    drafted = llm.generate(PROMPTS, _params(bad=1))
    proposer = llm.engine.speculator.proposer
    real = proposer.propose

    def broken(inp):
        if any(d.seed == BAD_SEED and len(d.token_ids) > 12 for d in inp.requests):
            raise RuntimeError("injected drafter failure")
        return real(inp)

    monkeypatch.setattr(proposer, "propose", broken)
    outs = llm.generate(PROMPTS, _params(bad=1))
    assert _ids(outs) == want
    assert llm.engine.num_drafter_failures == 1 and llm.engine.num_failed_requests == 0
    stats = [o.spec_decode_stats.num_drafts for o in outs]
    before = [o.spec_decode_stats.num_drafts for o in drafted]
    assert stats[1] < before[1]  # drafted until it failed, then not
    assert [s for i, s in enumerate(stats) if i != 1] == [s for i, s in enumerate(before) if i != 1]
    _check_forgotten(llm)


# ---- faults in the request hooks ----------------------------------------------------------------
def test_add_hook_fault_queues_nothing_and_keeps_nothing(tiny_llama, plain, monkeypatch) -> None:
    llm = _llm(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.engine
    proposer = engine.speculator.proposer
    real_add = proposer.add_request

    def broken(req_id: str) -> None:
        proposer.indexes[req_id] = object()  # some state set up before the fault
        raise KeyError("injected add fault")

    monkeypatch.setattr(proposer, "add_request", broken)
    req = engine.make_request("hello there", SP(temperature=0.0, max_tokens=4))
    with pytest.raises(DrafterError, match="could not take request") as info:
        engine.enqueue(req)
    assert not isinstance(info.value, ValueError)  # not the client's fault: never a 400
    del info
    assert _outside_frames(req) == []
    assert engine.num_drafter_failures == 1
    _check_forgotten(llm)
    # offline generate(): a fault on the third request leaves none of the call queued
    calls = {"n": 0}

    def third_fails(req_id: str) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected add fault")
        real_add(req_id)

    monkeypatch.setattr(proposer, "add_request", third_fails)
    with pytest.raises(DrafterError):
        llm.generate(PROMPTS, _params())
    _check_forgotten(llm)
    monkeypatch.undo()
    assert _ids(llm.generate(PROMPTS, _params())) == _ids(plain.generate(PROMPTS, _params()))


def test_remove_hook_fault_still_forgets_the_request(tiny_llama, plain, monkeypatch) -> None:
    llm = _llm(tiny_llama, {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False})
    engine = llm.engine
    proposer = engine.speculator.proposer
    real_remove = proposer.remove_request

    def broken(req_id, token_ids=None):
        real_remove(req_id, token_ids)
        raise RuntimeError("injected remove fault")

    monkeypatch.setattr(proposer, "remove_request", broken)
    sp = _params()
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, sp)]
    reqs = [engine.requests[i] for i in ids]
    engine.abort_request(ids[3])  # the abort path
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    want = _ids(plain.generate(PROMPTS[:3], sp[:3]))
    assert [outs[i].outputs[0].token_ids for i in ids[:3]] == want
    assert engine.num_drafter_failures == 4 and engine.num_failed_requests == 0
    _check_forgotten(llm)
    for req in reqs:
        assert _outside_frames(req, reqs) == []
