"""bad_words: the trie over reversed prefixes bans exactly what the former per-word scan banned
(kept here as the reference), vLLM's tokenization, and the per-word token limit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.sample.bad_words import MAX_BAD_WORD_TOKENS, BadWords, bad_words_token_ids
from specdec.sample.logprobs import LogitsAdjust


def _reference_banned(
    bad_words: tuple[tuple[int, ...], ...],
    output: tuple[int, ...],
    draft_token_ids: list[int],
    num_rows: int,
) -> set[tuple[int, int]]:
    """The former implementation: every row against every word."""
    banned = set()
    for r in range(num_rows):
        history = output + tuple(draft_token_ids[:r])
        for word in bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(history) and (
                not prefix or history[len(history) - len(prefix) :] == prefix
            ):
                banned.add((r, word[-1]))
    return banned


def _reference_token_ids(words: list[str], encode) -> tuple[tuple[int, ...], ...]:  # noqa: ANN001
    """The former tokenization: one word at a time."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def _chars(texts: list[str]) -> list[list[int]]:
    """A tokenizer of one token per character (a space is token 32)."""
    return [[ord(c) for c in t] for t in texts]


def _banned(bad: BadWords, output: tuple[int, ...], drafts: list[int]) -> set[tuple[int, int]]:
    logits = torch.zeros(len(drafts) + 1, 128)
    tail = output[max(0, len(output) - bad.max_prefix_len) :]
    adjusted = LogitsAdjust(bad_words=bad, output_tail=tail).apply(logits, drafts)
    assert not logits.isinf().any()  # the input is never changed
    return {(r, c) for r, c in (adjusted == float("-inf")).nonzero().tolist()}


# small alphabets: words overlap, share prefixes and suffixes, repeat, and match often
WORDS = st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=12)
TOKENS = st.lists(st.sampled_from([97, 98, 99]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(WORDS, TOKENS, TOKENS)
def test_bans_what_the_per_word_scan_banned(words, output, drafts) -> None:
    bad = BadWords.build(words, _chars)
    ids = bad_words_token_ids(words, _chars)
    expected = _reference_banned(ids, tuple(output), drafts, len(drafts) + 1)
    assert _banned(bad, tuple(output), drafts) == expected


def test_overlapping_and_multi_token_words() -> None:
    bad = BadWords.build(["ab", "bab", "b", "abc", "cab"], _chars)
    a, b, c = 97, 98, 99
    # row 0 follows "...ca": "ab" and "cab" ban b; row 1 follows "...cab": "abc" bans c
    assert _banned(bad, (c, a), [b]) == {(0, b), (1, b), (1, c)}
    assert _banned(bad, (), []) == {(0, b)}  # one-token words everywhere, even first
    # "bab" needs "ba" before it: after "a" alone only "ab" bans b
    assert bad.banned_after([a], 1) == [b]
    assert bad.banned_after([b, a], 2) == [b, b]  # "ab" and "bab" both ban b
    assert bad.max_prefix_len == 2


def test_tokenization_is_vllms(tiny_llama) -> None:
    from specdec import LLM

    tok = LLM(str(tiny_llama), max_model_len=64).get_tokenizer()
    words = ["the", " cat", "a b", "   ", "  leading", "é", "the cat sat"]
    expected = _reference_token_ids(words, lambda t: tok.encode(t, False))
    got = bad_words_token_ids(words, lambda texts: tok.encode_batch(texts, False))
    assert got == expected and len(got) > len(words) - 1


def test_a_word_over_the_token_limit_is_refused() -> None:
    at_limit = "a" * MAX_BAD_WORD_TOKENS
    BadWords.build([at_limit], _chars)
    with pytest.raises(
        ValueError, match=rf"^bad_words: word 1 is .* at most {MAX_BAD_WORD_TOKENS}"
    ):
        BadWords.build(["ok", at_limit + "a"], _chars)


def test_a_banned_word_is_never_produced_with_or_without_speculation(tiny_llama) -> None:
    from specdec import LLM, SamplingParams

    prompts = ["the cat sat on the mat and the cat", "a b a b a b a b a"]
    llm = LLM(str(tiny_llama), max_model_len=128, max_num_batched_tokens=32)
    tok = llm.get_tokenizer()
    sp = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**sp))]
    # words the plain outputs contain, as the tokenizer splits them: two tokens and one
    words = [tok.decode(plain[0][3:5]), tok.decode(plain[1][6:7])]
    banned = bad_words_token_ids(words, lambda texts: tok.encode_batch(texts, False))
    assert any(len(b) > 1 for b in banned)

    def contains(ids: list[int]) -> bool:
        return any(ids[i : i + len(b)] == list(b) for b in banned for i in range(len(ids)))

    assert any(contains(ids) for ids in plain)
    outs = llm.generate(prompts, SamplingParams(bad_words=words, **sp))
    got = [o.outputs[0].token_ids for o in outs]
    assert not any(contains(ids) for ids in got) and got != plain
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    spec = LLM(str(tiny_llama), max_model_len=128, speculative_config=ngram)
    spec_outs = spec.generate(prompts, SamplingParams(bad_words=words, **sp))
    assert [o.outputs[0].token_ids for o in spec_outs] == got
    assert spec.engine.spec_stats.num_draft_tokens > 0
