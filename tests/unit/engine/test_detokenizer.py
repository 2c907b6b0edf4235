"""IncrementalDetokenizer on tiny hand-built tokenizers (fast, no model files)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.model.tokenizer import Tokenizer
from tests.fixtures.tokenizers import byte_level_metadata, sentencepiece_metadata

TEXT = "hello world 😀 — 日本語 👨‍👩‍👧 the end 🇫🇷!"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(byte_level_metadata())


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(sentencepiece_metadata("gemma3"))


@pytest.fixture(scope="module")
def llama_spm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(sentencepiece_metadata("llama"))


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int]) -> list[str]:
    deltas: list[str] = []
    pos = 0
    for size in sizes:
        deltas.append(detok.add_tokens(ids[pos : pos + size]))
        pos += size
    assert pos == len(ids)
    deltas.append(detok.finalize())
    return deltas


def test_emoji_split_over_byte_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok, [1, 2], skip_special_tokens=True)
    assert [detok.add_tokens([i]) for i in ids] == ["", "", "", "😀"]
    assert detok.output_text == "😀"
    assert detok.finalize() == ""


def test_text_before_incomplete_character_is_emitted(tok: Tokenizer) -> None:
    ids = tok.encode("hello 😀")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    first = detok.add_tokens(ids[:-3])  # "hello" + space + first byte of the emoji
    assert first == "hello "
    assert detok.num_pending_tokens > 0
    assert detok.add_tokens(ids[-3:-1]) == ""
    assert detok.add_tokens(ids[-1:]) == "😀"
    assert detok.num_pending_tokens == 0


def test_many_tokens_at_once(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert detok.add_tokens(ids) == TEXT
    assert detok.add_tokens([]) == ""
    more = tok.encode(" and more 😀")
    assert detok.add_tokens(more) == " and more 😀"
    assert detok.output_text == TEXT + " and more 😀"
    assert detok.output_token_ids == ids + more


def test_finalize_flushes_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]  # last byte missing
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert detok.add_tokens(ids) == "ok "
    assert detok.finalize() == "\ufffd"
    assert detok.output_text == tok.decode(ids) == "ok \ufffd"
    assert detok.finalize() == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tok: Tokenizer, skip_special_tokens: bool) -> None:
    ids = tok.encode("hello<|im_end|>") + tok.encode("😀")[:2] + [0] + tok.encode("😀")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, [1] * len(ids))
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detok.output_text == expected
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def random_ids(rng: random.Random, t: Tokenizer, n: int) -> list[int]:
    """Valid text pieces mixed with single byte tokens, specials and cut multibyte characters."""
    pieces = ["hello", " world", "😀", "日本", " the", "\n", "—", "🇫🇷", "é", " "]
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.6:
            ids.extend(t.encode(rng.choice(pieces), add_special_tokens=False))
        elif r < 0.75:
            ids.extend(t.encode(rng.choice(pieces), add_special_tokens=False)[:1])
        elif r < 0.85:
            ids.append(rng.randrange(t.vocab_size))
        else:
            ids.append(rng.choice(sorted(t.eog_token_ids | {t.bos_token_id or 0})))
    return ids[:n]


@pytest.mark.parametrize("which", ["tok", "spm", "llama_spm"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_join_to_decode(
    request: pytest.FixtureRequest, which: str, skip_special_tokens: bool
) -> None:
    t: Tokenizer = request.getfixturevalue(which)
    rng = random.Random(1234)
    for trial in range(60):
        ids = random_ids(rng, t, rng.randrange(1, 80))
        sizes: list[int] = []
        left = len(ids)
        while left:
            size = min(left, rng.choice([1, 1, 1, 2, 3, 5, 17]))
            sizes.append(size)
            left -= size
        detok = IncrementalDetokenizer(t, [1, 2, 3], skip_special_tokens=skip_special_tokens)
        deltas = stream(detok, ids, sizes)
        expected = t.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, (trial, ids, deltas)
        assert detok.output_text == expected


@pytest.mark.parametrize("which", ["tok", "spm"])
def test_no_broken_utf8_mid_stream(request: pytest.FixtureRequest, which: str) -> None:
    t: Tokenizer = request.getfixturevalue(which)
    text = "a😀b€c日本語d👨‍👩‍👧e"
    ids = t.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(t, [], skip_special_tokens=True)
    for i in ids:
        assert "\ufffd" not in detok.add_tokens([i])
    assert detok.output_text == text


def test_byte_fallback_run_held_until_it_ends(spm: Tokenizer) -> None:
    ids = spm.encode("h€", add_special_tokens=False)  # h <0xE2> <0x82> <0xAC>
    detok = IncrementalDetokenizer(spm, [], skip_special_tokens=True)
    assert detok.add_tokens(ids) == "h"  # the run of byte tokens could still turn invalid
    assert detok.add_tokens(spm.encode("hello", add_special_tokens=False)) == "€hello"
    # An invalid byte after a valid run makes the whole run U+FFFD: still matches decode.
    ids2 = spm.encode("€", add_special_tokens=False) + [spm.token_to_id("<0xFF>") or 0]
    detok2 = IncrementalDetokenizer(spm, [], skip_special_tokens=True)
    out = stream(detok2, ids2 + spm.encode("hello", add_special_tokens=False), [1, 1, 1, 1, 1])
    assert "".join(out) == spm.decode(ids2 + spm.encode("hello", add_special_tokens=False))


def test_sentencepiece_leading_space_matches_decode(llama_spm: Tokenizer) -> None:
    ids = llama_spm.encode("hello world hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_spm, [2], skip_special_tokens=True)
    deltas = stream(detok, ids, [1] * len(ids))
    assert deltas[:3] == ["hello", " world", " hello"]
    assert "".join(deltas) == llama_spm.decode(ids)


class CountingTokenizer:
    """Proxy recording how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []
        self.byte_fallback_token_ids = inner.byte_fallback_token_ids
        self.special_token_ids = inner.special_token_ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(token_ids))
        return self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)


def max_window(t: Tokenizer, text: str) -> tuple[int, int]:
    ids = t.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(t)
    detok = IncrementalDetokenizer(counting, [], skip_special_tokens=True)  # type: ignore[arg-type]
    for i in ids:
        detok.add_tokens([i])
    detok.finalize()
    assert detok.output_text == text
    assert len(counting.sizes) <= 3 * len(ids)
    return max(counting.sizes), len(ids)


@pytest.mark.parametrize("which", ["tok", "spm"])
def test_cost_per_call_does_not_grow(request: pytest.FixtureRequest, which: str) -> None:
    t: Tokenizer = request.getfixturevalue(which)
    short, _ = max_window(t, TEXT * 5)
    long, n = max_window(t, TEXT * 50)
    assert n > 1000
    assert long == short
    # The window is the last emitted chunk plus the tokens of one character (or, with byte
    # fallback, of one run of byte tokens: the family emoji is 18 of them in the tiny vocab).
    assert long <= 24
