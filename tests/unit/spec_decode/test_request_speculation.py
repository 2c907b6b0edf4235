"""Per-request speculation control: SamplingParams.num_speculative_tokens (0 = off, else a cap)
and llama.cpp's speculative_n_min / speculative_p_min; output stays exactly plain decoding's."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams

PROMPTS = ["the the the the the the", "a b a b a b a b a b", "in the in the in the in"]


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), max_model_len=128)


def _self_draft(tiny_llama, adaptive: bool) -> LLM:
    """The tiny model drafting for itself: every step drafts its whole cap."""
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 5,
            "adaptive": adaptive}  # fmt: skip
    return LLM(str(tiny_llama), max_model_len=128, speculative_config=spec)


def _sp(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("adaptive", [False, True])
def test_off_and_capped_requests_in_one_batch(tiny_llama, plain, adaptive: bool) -> None:
    caps = [0, 2, None]
    outs = _self_draft(tiny_llama, adaptive).generate(
        PROMPTS, [_sp(num_speculative_tokens=c) for c in caps]
    )
    assert _ids(outs) == _ids(plain.generate(PROMPTS, _sp()))
    off, capped, free = (o.spec_decode_stats for o in outs)
    assert off.num_drafts == 0 and off.num_chosen_drafts == 0
    assert len(capped.accepted_per_pos) <= 2 and capped.num_draft_tokens <= 2 * capped.num_drafts
    if adaptive:  # the controller chooses within each request's limit
        assert capped.mean_chosen_k <= 2 and off.mean_chosen_k == 0
    else:
        assert len(capped.accepted_per_pos) == 2  # (the last steps are clipped by max_tokens)
        assert len(free.accepted_per_pos) == 5


def test_n_min_drops_short_drafts(tiny_llama, plain) -> None:
    # ngram sizes its own drafts: on the real model's code edit some are shorter than k
    from specdec.cli import DEFAULT_PROMPT

    spec = {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}
    llm = LLM("smollm2-135m", max_model_len=1024, speculative_config=spec)
    chat = [{"role": "user", "content": DEFAULT_PROMPT}]
    prompt = llm.get_tokenizer().apply_chat_template(chat, add_generation_prompt=True)
    sp = {"temperature": 0.0, "max_tokens": 48}
    free, five = (
        llm.generate([prompt], SamplingParams(**sp, speculative_n_min=n))[0] for n in (0, 5)
    )
    assert five.outputs[0].token_ids == free.outputs[0].token_ids
    a, b = free.spec_decode_stats, five.spec_decode_stats
    assert a.num_draft_tokens < 5 * a.num_drafts  # some drafts were short...
    assert b.num_draft_tokens == 5 * b.num_drafts > 0  # ...and were not verified
    # n_min above the cap: nothing is verified, the output is the same
    outs = _self_draft(tiny_llama, False).generate(
        PROMPTS, _sp(speculative_n_min=3, num_speculative_tokens=2)
    )
    assert _ids(outs) == _ids(plain.generate(PROMPTS, _sp()))
    assert all(o.spec_decode_stats.num_drafts == 0 for o in outs)


def test_p_min_cuts_unlikely_drafts(tiny_llama) -> None:
    spec = {
        "method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4,
        "draft_sample_method": "probabilistic", "adaptive": False,
    }  # fmt: skip
    llm = LLM(str(tiny_llama), max_model_len=128, speculative_config=spec)
    sp = {"temperature": 1.0, "seed": 3, "max_tokens": 24, "ignore_eos": True}
    free = llm.generate(PROMPTS, SamplingParams(**sp))
    cut = llm.generate(PROMPTS, SamplingParams(**sp, speculative_p_min=0.3))
    none = llm.generate(PROMPTS, SamplingParams(**sp, speculative_p_min=1.0))
    drafted = [sum(o.spec_decode_stats.num_draft_tokens for o in outs) for outs in (free, cut)]
    assert drafted[0] > drafted[1] > 0  # the random tiny model is rarely that sure
    assert sum(o.spec_decode_stats.num_draft_tokens for o in none) == 0
    # the seed repeats (fixed k) and every request ends as asked
    again = llm.generate(PROMPTS, SamplingParams(**sp, speculative_p_min=0.3))
    assert _ids(again) == _ids(cut)
    assert all(len(o.outputs[0].token_ids) == 24 for o in cut)


def test_engine_default_n_min_from_llama_cpp_flag(tiny_llama, plain) -> None:
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    llm = LLM(str(tiny_llama), max_model_len=128, speculative_config=spec, draft_min=4)
    outs = llm.generate(PROMPTS, _sp())  # k 3 < draft_min 4: nothing is verified
    assert _ids(outs) == _ids(plain.generate(PROMPTS, _sp()))
    assert all(o.spec_decode_stats.num_drafts == 0 for o in outs)
    outs = llm.generate(PROMPTS, _sp(speculative_n_min=0))  # a request's own n_min wins
    assert all(len(o.spec_decode_stats.accepted_per_pos) == 3 for o in outs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"speculative_n_min": 1.5}, "speculative_n_min"),
        ({"speculative_p_min": 2.0}, "speculative_p_min"),
    ],
)
def test_bad_values_name_the_field(kwargs, needle: str) -> None:
    with pytest.raises(ValueError, match=f"^{needle}"):
        SamplingParams(**kwargs)
