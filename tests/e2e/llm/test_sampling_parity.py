"""vLLM's sampling API (n, best_of, logprobs=N, prompt_logprobs, logit_bias, bad_words,
cumulative_logprob), exact under every drafter: the same tokens and the same log-probabilities
as plain decoding."""

from __future__ import annotations

import math

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.outputs import Logprob
from specdec.spec_decode import METHODS
from tests.fixtures.heads import method_cases

PROMPTS = ["the cat sat on the mat and the cat", "hello there my friend", "a b a b a b a b a"]


def _llm(target: str, spec: dict | None = None, **kw) -> LLM:
    args = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32) | kw
    return LLM(target, speculative_config=spec, **args)


def _params(llm: LLM) -> list[SamplingParams]:
    tok = llm.get_tokenizer()
    bias = {tok.encode("e", False)[0]: 2.5, tok.encode("t", False)[0]: -100.0}
    common = {"max_tokens": 16, "ignore_eos": True}
    return [
        SamplingParams(temperature=0, logprobs=5, prompt_logprobs=3, logit_bias=bias, **common),
        SamplingParams(temperature=0, logprobs=0, bad_words=["the", "a b"], **common),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=11,
            logprobs=3,
            logit_bias=bias,
            bad_words=[" cat"],
            n=2,
            best_of=3,
            **common,
        ),  # fmt: skip
    ]


def _view(outs) -> list:
    return [
        (c.index, c.token_ids, c.logprobs, c.cumulative_logprob, o.prompt_logprobs)
        for o in outs
        for c in o.outputs
    ]


@pytest.fixture(scope="module")
def cases(tiny_llama, tiny_draft, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    # the EAGLE-3 head with a reduced draft vocabulary: sampled drafts through its d2t map
    return method_cases(
        tiny_llama, tiny_draft, tmp_path_factory.mktemp("heads"), skip_layers=2,
        eagle3_layout="safeailab", draft_vocab=150,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain(tiny_llama) -> list:
    llm = _llm(str(tiny_llama))
    return _view(llm.generate(PROMPTS, _params(llm)))


@pytest.mark.parametrize("method", list(METHODS))
def test_every_option_exact_under_every_drafter(method, cases, plain) -> None:
    assert method in cases, f"method {method!r} has no case in this test"
    target, spec = cases[method]
    llm = _llm(target, spec | {"num_speculative_tokens": 3, "adaptive": False})
    got = _view(llm.generate(PROMPTS, _params(llm)))
    assert got == plain  # tokens, logprob dicts, cumulative and prompt logprobs: all equal
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_logprobs_are_the_raw_target_distribution(tiny_llama) -> None:
    llm = _llm(str(tiny_llama))
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=4, prompt_logprobs=2)
    out = llm.generate(PROMPTS[1], sp)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    # the model's own logits over the whole sequence, one forward, as reference
    ref = LLM(str(tiny_llama), max_model_len=128, enable_prefix_caching=False)
    lp = _reference_logprobs(ref, ids)  # [len(ids) - 1, V]: row i predicts ids[i + 1]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    positions = [(d, 2) for d in out.prompt_logprobs[1:]] + [(d, 4) for d in c.logprobs]
    for i, (d, num_top) in enumerate(positions):
        token, row = ids[i + 1], lp[i]
        assert d[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert d[token].rank == int((row > row[token]).sum()) + 1
        top = [int(x) for x in row.topk(num_top).indices]
        assert set(d) == {token, *top}  # the token, then the raw distribution's top-N
        assert [d[t].rank for t in top] == list(range(1, num_top + 1))
        assert all(isinstance(v, Logprob) and v.decoded_token is not None for v in d.values())
    assert c.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids))
    )
    # greedy: the chosen token is the top one
    assert all(d[t].rank == 1 for d, t in zip(c.logprobs, c.token_ids))


def _reference_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    from specdec.model.llama import SeqBatch

    model, kv = llm.engine.model, llm.engine.kv
    slot = kv.allocate()
    with torch.inference_mode():
        hidden = model.forward(
            torch.tensor(ids), torch.arange(len(ids)), SeqBatch([slot], [0], [len(ids)]), kv
        )
        logits = model.compute_logits(hidden)
    kv.free(slot)
    return logits[:-1].float().log_softmax(-1)


def test_logit_bias_and_bad_words_change_what_is_drawn(tiny_llama) -> None:
    llm = _llm(str(tiny_llama))
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(PROMPTS, base)
    first = plain[0].outputs[0].token_ids[0]
    banned = llm.generate(PROMPTS, SamplingParams(**{**_kw(base), "logit_bias": {first: -100}}))
    assert first not in banned[0].outputs[0].token_ids
    forced = llm.generate(PROMPTS, SamplingParams(**{**_kw(base), "logit_bias": {5: 100}}))
    assert all(set(o.outputs[0].token_ids) == {5} for o in forced)
    # bad words: a one-token word never appears; a two-token word never completes
    one, two = tok.encode("e", False), tok.encode("a b", False)
    assert len(one) == 1 and len(two) > 1
    outs = llm.generate(PROMPTS, SamplingParams(**{**_kw(base), "bad_words": ["e", "a b"]}))
    for o in outs:
        t = o.outputs[0].token_ids
        assert one[0] not in t
        assert all(t[i : i + len(two)] != two for i in range(len(t)))


def _kw(sp: SamplingParams) -> dict:
    return {"temperature": sp.temperature, "max_tokens": sp.max_tokens, "ignore_eos": True}


def test_n_and_best_of_share_the_prompt_and_are_exact(tiny_llama) -> None:
    llm = _llm(str(tiny_llama))
    prompt = PROMPTS[0]
    num_prompt = len(llm.get_tokenizer().encode(prompt))
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, n=3)
    out = llm.generate(prompt, sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [
        llm.generate(
            prompt,
            SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10, ignore_eos=True, logprobs=0),
        )[0].outputs[0]  # fmt: skip
        for i in range(4)
    ]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in singles[:3]]
    assert out.outputs[0].logprobs is None  # not asked for
    # the samples copied the prompt's KV from one shared prefill
    assert out.num_cached_tokens == num_prompt - 1
    # best_of: the n of highest cumulative log-probability among best_of samples
    best = llm.generate(prompt, SamplingParams(**{**_kw(sp), "temperature": 1.0, "seed": 7,
                                                  "n": 2, "best_of": 4}))[0]  # fmt: skip
    ranked = sorted(singles, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best.outputs] == [c.cumulative_logprob for c in ranked]
    assert best.outputs[0].logprobs is None and not math.isnan(best.outputs[0].cumulative_logprob)
    with pytest.raises(ValueError, match="best_of must be >= n"):
        SamplingParams(n=3, best_of=2)


def test_prompt_logprobs_do_not_read_the_prefix_cache(tiny_llama) -> None:
    llm = _llm(str(tiny_llama))
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    first, second = (llm.generate(PROMPTS[0], sp)[0] for _ in range(2))
    assert second.num_cached_tokens == 0 and first.prompt_logprobs == second.prompt_logprobs
    cached = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0]
    assert cached.num_cached_tokens > 0  # without prompt_logprobs the cache serves it
