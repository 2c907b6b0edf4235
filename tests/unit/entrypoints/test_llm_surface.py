"""vLLM's offline ``LLM`` surface beyond generate / chat: ``get_metrics()`` (vLLM's metrics
reader shapes) and ``beam_search()`` (vLLM's BeamSearchParams / BeamSearchOutput), on the real
small model."""

from __future__ import annotations

import dataclasses
import math

import pytest

from specdec import LLM, BeamSearchParams, SamplingParams, TextPrompt, TokensPrompt
from specdec import metrics_reader as reader
from specdec.beam_search import BeamSearchOutput, BeamSearchSequence, get_beam_search_score

PROMPT = "The capital of France is"

# vllm/v1/metrics/reader.py's dataclasses as vLLM documents them: field -> annotation
VLLM_READER = {
    "Metric": {"name": "str", "labels": "dict[str, str]"},
    "Counter": {"name": "str", "labels": "dict[str, str]", "value": "int"},
    "Gauge": {"name": "str", "labels": "dict[str, str]", "value": "float"},
    "Vector": {"name": "str", "labels": "dict[str, str]", "values": "list[int]"},
    "Histogram": {
        "name": "str", "labels": "dict[str, str]", "count": "int", "sum": "float",
        "buckets": "dict[str, int]",
    },
}  # fmt: skip
# vllm/beam_search.py's BeamSearchSequence fields a user reads (vLLM adds its prompt and LoRA)
VLLM_BEAM_FIELDS = ("tokens", "logprobs", "cum_logprob", "text", "finish_reason", "stop_reason")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", max_model_len=256)


def test_metric_dataclasses_have_vllms_fields() -> None:
    for cls_name, want in VLLM_READER.items():
        cls = getattr(reader, cls_name)
        got = {f.name: f.type for f in dataclasses.fields(cls)}
        assert got == want, cls_name
        if cls_name != "Metric":
            assert issubclass(cls, reader.Metric)
    assert [f.name for f in dataclasses.fields(BeamSearchOutput)] == ["sequences"]
    assert [f.name for f in dataclasses.fields(BeamSearchSequence)] == list(VLLM_BEAM_FIELDS)
    assert [f.name for f in dataclasses.fields(BeamSearchParams)] == [
        "beam_width", "max_tokens", "ignore_eos", "temperature", "length_penalty",
        "include_stop_str_in_output",
    ]  # fmt: skip


def _by_name(metrics: list[reader.Metric]) -> dict[str, reader.Metric]:
    return {m.name: m for m in metrics}


def test_get_metrics_moves_with_generate(llm: LLM) -> None:
    before = _by_name(llm.get_metrics())
    assert before and all(name.startswith("vllm:") for name in before)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    after = _by_name(llm.get_metrics())
    for name, grew in (
        ("vllm:prompt_tokens", len(out.prompt_token_ids)),
        ("vllm:generation_tokens", len(out.outputs[0].token_ids)),
    ):
        assert isinstance(after[name], reader.Counter) and isinstance(after[name].value, int)
        assert after[name].value - before[name].value == grew, name
        assert after[name].labels == {"model_name": "smollm2-135m"}
    e2e = after["vllm:e2e_request_latency_seconds"]
    assert isinstance(e2e, reader.Histogram)
    earlier = before.get("vllm:e2e_request_latency_seconds")  # no series before a request
    assert e2e.count == (earlier.count if earlier else 0) + 1
    assert e2e.buckets["+Inf"] == e2e.count and e2e.sum > 0
    counts = list(e2e.buckets.values())
    assert counts == sorted(counts)  # cumulative, as Prometheus keeps them
    assert isinstance(after["vllm:num_requests_running"], reader.Gauge)
    success = [m for m in llm.get_metrics() if m.name == "vllm:request_success"]
    assert any(m.labels.get("finished_reason") == "length" for m in success)


def test_get_metrics_reads_accepted_per_position_as_a_vector() -> None:
    llm = LLM(
        "smollm2-135m", max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    prompt = "one two three four one two three four one two three four one two"
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    metrics = _by_name(llm.get_metrics())
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, reader.Vector) and "position" not in per_pos.labels
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert sum(per_pos.values) == accepted.value > 0


def test_get_metrics_off_with_disable_log_stats(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), max_model_len=64, disable_log_stats=True)
    with pytest.raises(RuntimeError, match="disable_log_stats"):
        llm.get_metrics()


def _greedy(llm: LLM, prompt: str, n: int) -> tuple[list[int], float]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.cumulative_logprob


def _rescored(llm: LLM, tokens: list[int], num_prompt: int) -> float:
    """The log-probability of tokens[num_prompt:] after the prompt, from one prefill."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": tokens}, sp, use_tqdm=False)[0]
    return sum(out.prompt_logprobs[j][tokens[j]].logprob for j in range(num_prompt, len(tokens)))


def test_beam_width_one_is_greedy(llm: LLM) -> None:
    tokens, _ = _greedy(llm, PROMPT, 12)
    num_prompt = len(llm.get_tokenizer().encode(PROMPT))
    for prompt in (PROMPT, TextPrompt(prompt=PROMPT)):
        params = BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True)
        (out,) = llm.beam_search([prompt], params)
        (seq,) = out.sequences
        assert seq.tokens[num_prompt:] == tokens and seq.finish_reason == "length"
        assert seq.text == llm.get_tokenizer().decode(seq.tokens, skip_special_tokens=False)


def test_beam_search_ranks_by_score_and_scores_are_the_models(llm: LLM) -> None:
    n = 10
    ids = llm.get_tokenizer().encode(PROMPT)
    params = BeamSearchParams(beam_width=3, max_tokens=n, ignore_eos=True)
    outs = llm.beam_search([TokensPrompt(prompt_token_ids=ids), PROMPT], params)
    assert len(outs) == 2 and outs[0] == outs[1]  # the same prompt, as ids or as text
    seqs = outs[0].sequences
    assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
    eos = llm.get_tokenizer().eog_token_ids
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, 1.0) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    for s in seqs:
        assert s.tokens[: len(ids)] == ids and len(s.tokens) == len(ids) + n
        generated = s.tokens[len(ids) :]
        steps = sum(lp[t].logprob for lp, t in zip(s.logprobs, generated))
        assert s.cum_logprob == pytest.approx(steps, abs=1e-6)
        assert s.cum_logprob == pytest.approx(_rescored(llm, s.tokens, len(ids)), abs=2e-3)
    _, greedy_logprob = _greedy(llm, PROMPT, n)
    assert seqs[0].cum_logprob >= greedy_logprob - 1e-4


def test_beam_search_finishes_beams_at_eos(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    (out,) = llm.beam_search(PROMPT, params)
    eos = llm.get_tokenizer().eog_token_ids
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped, [s.text for s in out.sequences]  # "Paris." then the end of text
    for s in stopped:
        assert s.tokens[-1] in eos and s.stop_reason is None
        assert s.text == llm.get_tokenizer().decode(s.tokens[:-1], skip_special_tokens=False)
    (kept,) = llm.beam_search(PROMPT, dataclasses.replace(params, include_stop_str_in_output=True))
    for s in kept.sequences:
        if s.finish_reason == "stop":
            assert s.text == llm.get_tokenizer().decode(s.tokens, skip_special_tokens=False)


def test_beam_search_params_are_checked(llm: LLM) -> None:
    for bad in ({"beam_width": 0}, {"beam_width": 11}, {"max_tokens": 0},
                {"temperature": -1.0}, {"length_penalty": math.inf}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        llm.beam_search([PROMPT, {"text": "x"}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="LoRA"):
        llm.beam_search(PROMPT, BeamSearchParams(2, 2), lora_request=object())
