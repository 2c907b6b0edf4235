"""Speculation figures at the edges: drafts the verifier accepted past a stop (EOS, a stop token,
a stop string) are never output, so no figure counts them (vLLM issue 56101 counted them); the
rates follow vLLM's definitions (README, "Acceptance figures")."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.bench.aggregate import merge_spec
from specdec.entrypoints.openai.stats import timings, vllm_spec_metrics
from specdec.metrics import EngineMetrics
from specdec.spec_decode.metrics import SpecDecodeStats

K = 5
PROMPT = "hello world"
COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "generation_tokens",
)


@pytest.fixture(scope="module")
def self_draft(tiny_llama) -> LLM:
    """The tiny model drafting for itself: every draft is accepted, every step drafts K."""
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": K,
            "adaptive": False}  # fmt: skip
    return LLM(str(tiny_llama), max_model_len=128, speculative_config=spec)


def _plain_tokens(llm: LLM) -> list[int]:
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, num_speculative_tokens=0)
    return llm.generate([PROMPT], sp)[0].outputs[0].token_ids


def _stop_inside_run(llm: LLM, tokens: list[int], how: str) -> tuple[int, str]:
    """A position inside the first full run (prefill gives token 0, step 1 tokens 1..K+1) where a
    stop of kind ``how`` ends the output first, with accepted drafts left after it; and the stop
    string (for "stop_string": the whole text up to it)."""
    decode = llm.get_tokenizer().decode
    for pos in range(2, K):
        if how != "stop_string":
            if tokens[pos] not in tokens[:pos]:
                return pos, ""
            continue
        text, before = decode(tokens[: pos + 1]), decode(tokens[:pos])
        if "\ufffd" not in text and len(text) > len(before):
            return pos, text
    pytest.fail(f"no position for a {how} inside the first run")


def _run(llm: LLM, sp: SamplingParams, metrics: EngineMetrics) -> tuple:
    engine = llm.engine
    gen_before = engine.num_generation_tokens
    engine.add_request(PROMPT, sp)
    flags: list[bool] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            flags += [p.from_draft for p in out.delta_provenance]
            final = out
        metrics.update(engine)
    assert final is not None and final.finished
    return final, flags, engine.num_generation_tokens - gen_before


def _counter(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"vllm:{name}_total", {"model_name": "m"})
    return value or 0.0


@pytest.mark.parametrize("how", ["eos", "stop_token", "stop_string"])
def test_drafts_accepted_past_a_stop_are_not_counted(self_draft, how: str) -> None:
    llm = self_draft
    tokens = _plain_tokens(llm)
    pos, text = _stop_inside_run(llm, tokens, how)
    sched = llm.engine.scheduler
    eog = set(sched.eog_token_ids)
    kw: dict = {"temperature": 0, "max_tokens": 40}
    if how == "eos":
        sched.eog_token_ids = eog | {tokens[pos]}
    elif how == "stop_token":
        kw.update(ignore_eos=True, stop_token_ids=[tokens[pos]])
    else:
        kw.update(ignore_eos=True, stop=[text], include_stop_str_in_output=True)
    metrics = EngineMetrics("m")
    metrics.update(llm.engine)  # the counters start from the engine's totals so far
    before = {n: _counter(metrics, n) for n in COUNTERS}
    try:
        final, flags, num_generated = _run(llm, SamplingParams(**kw), metrics)
    finally:
        sched.eog_token_ids = eog
    out = final.outputs[0]
    assert out.token_ids == tokens[: pos + 1] and out.finish_reason == "stop"
    # one verification step carried K drafts, all accepted; pos of them were output
    st = final.spec_decode_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, K, pos)
    assert st.accepted_per_pos == [1] * pos + [0] * (K - pos)
    assert st.mean_acceptance_length == 1 + pos
    assert st.acceptance_rate == pos / K
    assert sum(flags) == pos and len(flags) == pos + 1
    assert num_generated == pos + 1
    # the engine's totals and the Prometheus counters
    grown = {n: _counter(metrics, n) - before[n] for n in COUNTERS}
    assert grown == {
        "spec_decode_num_drafts": 1,
        "spec_decode_num_draft_tokens": K,
        "spec_decode_num_accepted_tokens": pos,
        "generation_tokens": pos + 1,
    }
    # the server's per-request figures
    t = timings(10, 0, len(out.token_ids), [final.metrics], st)
    assert (t["draft_n"], t["draft_n_accepted"]) == (K, pos)
    vllm = vllm_spec_metrics(st, K)["speculative_decoding"]
    assert vllm["num_accepted_draft_tokens"] == pos
    assert vllm["acceptance_histogram"] == [0] * pos + [1] + [0] * (K - pos)


def test_rates_are_vllm_definitions() -> None:
    # three verification steps: 5 drafts / 2 accepted, 3 / 3 (all: the bonus token is the
    # target's, not a draft), 4 / 0
    st = SpecDecodeStats()
    for proposed, accepted in [(5, 2), (3, 3), (4, 0)]:
        st.observe(proposed, accepted)
    st.observe(0, 0)  # a step without drafts is no verification of drafts
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 12, 5)
    assert st.acceptance_rate == 5 / 12  # over proposed drafts: not per step, no bonus token
    assert st.mean_acceptance_length == 1 + 5 / 3  # 1 + accepted per verification step
    assert st.acceptance_rate_per_pos() == [2 / 3, 2 / 3, 1 / 3, 0, 0]
    assert SpecDecodeStats().mean_acceptance_length == 1.0
    assert SpecDecodeStats().acceptance_rate == 0.0
    # the benchmarks' sums over requests give the same figures
    halves = [SpecDecodeStats(), SpecDecodeStats()]
    halves[0].observe(5, 2)
    halves[1].observe(3, 3)
    halves[1].observe(4, 0)
    merged = merge_spec([{"spec_decode": h.as_dict()} for h in halves])
    assert merged is not None
    assert merged["acceptance_rate"] == st.acceptance_rate
    assert merged["mean_acceptance_length"] == st.mean_acceptance_length
    assert merged["acceptance_rate_per_pos"] == st.acceptance_rate_per_pos()
    # vLLM's per-request summary and llama.cpp's timings
    vllm = vllm_spec_metrics(st, 5)["speculative_decoding"]
    assert vllm["draft_acceptance_rate"] == 5 / 12
    assert vllm["mean_acceptance_length"] == 1 + 5 / 3
    assert vllm["acceptance_histogram"] == [1, 0, 1, 1, 0, 0]
    assert sum(vllm["acceptance_histogram"]) == vllm["num_spec_steps"] == 3


class _BrokenGrammar:
    def failure(self) -> str:
        return "the grammar worker gave up"


def test_a_step_that_commits_nothing_counts_no_accepted_drafts(tiny_llama) -> None:
    # a request whose grammar failed before the step's tokens were committed: the count of the
    # step's committed tokens (what the accepted drafts are clipped to) is 0, not the last step's
    from specdec.engine.scheduler import GrammarViolation
    from specdec.sample.rejection_sampler import VerifyResult

    llm = LLM(str(tiny_llama), max_model_len=128)
    engine = llm.engine
    req_id = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    req = engine.requests[req_id]
    req.num_step_committed = 4
    req.grammar = _BrokenGrammar()
    with pytest.raises(GrammarViolation):
        engine.scheduler._commit(req, VerifyResult([1, 2, 3, 4], 3, None))
    assert req.num_step_committed == 0
    req.grammar = None
