"""One request's failure never touches another's (issue 16): failures injected into the
sampler and the model for one request of a batch (a drafter's: test_drafter_faults.py);
offline generate() checks every request before queuing any; cache_salt keeps prefixes apart."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.sample import rejection_sampler
from specdec.sampling_params import SamplingParams as SP

PROMPTS = ["the cat sat on the mat", "a b c a b c a b", "Once upon a time", "hello there"]
BAD_SEED = 666


def _params(bad: int | None, temperature: float = 0.0) -> list[SP]:
    return [
        SP(
            temperature=temperature,
            max_tokens=20,
            ignore_eos=True,
            seed=BAD_SEED if i == bad else i,
        )
        for i in range(len(PROMPTS))
    ]


def _llm(tiny_llama, spec: dict | None = None) -> LLM:
    return LLM(
        str(tiny_llama),
        speculative_config=spec,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )


def _check_isolated(llm: LLM, outs, want, bad: int, needle: str, temperature: float = 0.0) -> None:
    assert outs[bad].outputs[0].finish_reason == "error"
    assert needle in (outs[bad].error or "")
    for i, o in enumerate(outs):
        if i != bad:
            assert o.error is None and o.outputs[0].token_ids == want[i].outputs[0].token_ids
    assert llm.engine.num_failed_requests == 1
    assert llm.engine.kv.num_used_slots == 0 and not llm.engine.has_unfinished_requests()
    # The engine goes on serving, and nothing of the failed request is reused.
    again = llm.generate(PROMPTS, _params(None, temperature))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_fail_one_request(tiny_llama, monkeypatch, temperature) -> None:
    llm = _llm(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3})
    want = llm.generate(PROMPTS, _params(None, temperature))
    llm.engine.scheduler.num_failed_requests = 0
    real = rejection_sampler.processed_logits

    def poisoned(logits, sp, mask, counts):
        out = real(logits, sp, mask, counts)
        return out * float("nan") if sp.seed == BAD_SEED else out

    monkeypatch.setattr(rejection_sampler, "processed_logits", poisoned)
    outs = llm.generate(PROMPTS, _params(1, temperature))
    monkeypatch.undo()
    _check_isolated(llm, outs, want, 1, "not finite", temperature)


def test_sampler_error_fails_one_request(tiny_llama, monkeypatch, caplog) -> None:
    """The failed request's error is a fixed message (the exception's text may be client text or
    internal state); the log has one line with the exception's type."""
    llm = _llm(tiny_llama)
    want = llm.generate(PROMPTS, _params(None))
    llm.engine.scheduler.num_failed_requests = 0
    real = rejection_sampler.verify

    def broken(logits, drafts, probs, sp, penalty, seed, position, *rest):
        if sp.seed == BAD_SEED and position == 3:
            raise RuntimeError("injected sampler failure 'client text'\nstate: {dump}")
        return real(logits, drafts, probs, sp, penalty, seed, position, *rest)

    monkeypatch.setattr("specdec.worker.model_runner.verify", broken)
    caplog.set_level("WARNING", logger="specdec")
    outs = llm.generate(PROMPTS, _params(2))
    monkeypatch.undo()
    assert len(outs[2].outputs[0].token_ids) == 3  # the tokens before the failure stay
    assert outs[2].error == "sampling failed"
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "RuntimeError" in lines[0], lines
    assert "state" not in lines[0]
    _check_isolated(llm, outs, want, 2, "sampling failed")


def test_model_error_fails_one_request(tiny_llama, monkeypatch) -> None:
    """The batched forward fails on one request's positions: each request is re-run alone and
    only that one fails."""
    llm = _llm(tiny_llama)
    prompts = list(PROMPTS)
    prompts[3] = "the " * 60  # the only request that reaches position 50
    want = llm.generate(prompts, _params(None))
    llm.engine.scheduler.num_failed_requests = 0
    model = llm.engine.model
    real = model.forward_capture

    def broken(ids, positions, batch, kv, *args, **kw):
        if bool((positions >= 50).any()):
            raise RuntimeError("injected model failure")
        return real(ids, positions, batch, kv, *args, **kw)

    monkeypatch.setattr(model, "forward_capture", broken)
    outs = llm.generate(prompts, _params(None))
    monkeypatch.undo()
    assert (
        outs[3].outputs[0].finish_reason == "error" and outs[3].error == "the forward pass failed"
    )
    for i in range(3):
        assert outs[i].outputs[0].token_ids == want[i].outputs[0].token_ids
    assert llm.engine.num_failed_requests == 1 and llm.engine.kv.num_used_slots == 0


def test_generate_checks_every_request_before_queuing_any(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    sp = SP(temperature=0, max_tokens=5)
    with pytest.raises(ValueError, match=r"prompts\[2\]: prompt has \d+ tokens"):
        llm.generate(["ok", "fine", "x" * 500, "also fine"], sp)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        llm.generate(["ok", []], sp)
    with pytest.raises(
        ValueError, match=r"prompts\[2\]: .*lone surrogate \(U\+D800\) at character 1"
    ):
        llm.generate(["ok", "fine", "a\ud800b"], sp)
    bad = SP(temperature=0.5)
    bad.temperature = float("nan")
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: temperature must be a finite"):
        llm.generate(["ok", "fine"], [sp, bad])
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used_slots == 0
    outs = llm.generate(["ok"], sp)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 5


def test_a_failed_step_leaves_nothing_behind(tiny_llama, monkeypatch) -> None:
    """An error outside any one request (here the scheduler) fails the call; its requests are
    aborted, so the next call runs only its own and no KV slot leaks."""
    llm = _llm(tiny_llama)
    sched = llm.engine.scheduler
    real = sched.schedule
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected scheduler failure")
        return real()

    monkeypatch.setattr(sched, "schedule", flaky)
    with pytest.raises(RuntimeError, match="injected scheduler failure"):
        llm.generate(PROMPTS, _params(None))
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used_slots == 0
    outs = llm.generate(["hello"], SP(temperature=0, max_tokens=4))
    assert [o.prompt for o in outs] == ["hello"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", float("inf")),
        ("temperature", float("nan")),
        ("temperature", 1e9),
        ("top_p", 0.0),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("seed", 2**70),
        ("max_tokens", 2**40),
        ("top_k", True),
    ],
)
def test_sampling_params_name_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_cache_salt_keeps_prefixes_apart(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    engine = llm.engine
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    sp = SP(temperature=0, max_tokens=2)

    def cached(salt: str | None) -> int:
        rid = engine.add_request(prompt, sp, cache_salt=salt)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    out = o
        return out.num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another tenant does not see tenant a's prefix
    assert cached(None) == 0
    assert cached("tenant-a") > 0
    assert cached(None) > 0
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, sp, cache_salt="")
