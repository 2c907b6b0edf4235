"""Our GGUF tokenizers against transformers' for the same files (SmolLM2 135M, Gemma 3 270M).

The reference is `AutoTokenizer.from_pretrained(folder, gguf_file=name)`. Each side is loaded
once per module: transformers takes ~10 s per model, and reading Gemma's GGUF metadata a few more.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.model.gguf_file import gguf_metadata, read_gguf
from specdec.model.registry import resolve_model_path
from specdec.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

CORPUS_FILE = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizer_corpus.txt"
CORPUS: list[str] = CORPUS_FILE.read_bytes().decode("utf-8").split("\n%%%%\n")

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one line."},
    {"role": "user", "content": "What is 12 × 7? Show it like `12*7`."},
    {"role": "assistant", "content": "84 — i.e. 12*7 = 84 ✅"},
    {"role": "user", "content": "And in 日本語?\n\tKeep  the   spacing."},
]

# A Gemma-style template of our own, to compare rendering and tokenization with BOS written by
# the template (Gemma 3 270M's GGUF is the base model and ships no chat template).
TURN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass
class Pair:
    name: str
    ours: Tokenizer
    ref: Any  # transformers tokenizer
    build_seconds: float


def load_pair(model: str) -> Pair:
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    metadata = gguf_metadata(read_gguf(path))
    start = time.perf_counter()
    ours = Tokenizer.from_gguf_metadata(metadata)
    build_seconds = time.perf_counter() - start
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Pair(model, ours, ref, build_seconds)


@pytest.fixture(scope="module")
def smollm(shared_gguf_readers) -> Pair:
    return load_pair("smollm2-135m")


@pytest.fixture(scope="module")
def gemma(shared_gguf_readers) -> Pair:
    return load_pair("gemma3-270m")


@pytest.fixture(scope="module", params=["smollm", "gemma"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return request.getfixturevalue(request.param)


def test_same_pipeline_as_transformers(pair: Pair) -> None:
    """Normalizer, pre-tokenizer, model (vocab + merges), added tokens, post-processor, decoder."""
    ours = json.loads(pair.ours.hf.to_str())
    ref = json.loads(pair.ref.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"):
        assert ours[key] == ref[key], key
    for key in ref["model"]:
        assert ours["model"][key] == ref["model"][key], key


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_corpus_ids_match(pair: Pair, add_special_tokens: bool) -> None:
    for text in CORPUS:
        ours = pair.ours.encode(text, add_special_tokens=add_special_tokens)
        ref = pair.ref.encode(text, add_special_tokens=add_special_tokens)
        assert ours == ref, text
    joined = "\n".join(CORPUS)
    assert pair.ours.encode(joined) == pair.ref.encode(joined)
    assert pair.ours.encode("") == pair.ref.encode("")
    assert pair.ours.encode_batch(CORPUS) == [pair.ref.encode(t) for t in CORPUS]


def test_bos(smollm: Pair, gemma: Pair) -> None:
    # SmolLM2's GGUF says add_bos_token = false, Gemma's true; both as in transformers.
    assert smollm.ours.add_bos_token is False
    assert smollm.ours.encode("hi") == smollm.ref.encode("hi")
    assert gemma.ours.add_bos_token is True
    assert gemma.ours.encode("hi")[0] == gemma.ours.bos_token_id == gemma.ref.bos_token_id == 2


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_and_round_trip(pair: Pair, skip_special_tokens: bool) -> None:
    for text in CORPUS:
        ids = pair.ours.encode(text, add_special_tokens=False)
        ours = pair.ours.decode(ids, skip_special_tokens=skip_special_tokens)
        ref = pair.ref.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours == ref, text
        if not skip_special_tokens:
            if pair.name == "gemma3-270m" and "\u2581" in text:
                # Gemma's decoder turns "▁" (its space symbol) into a space, so a literal "▁"
                # in the text does not survive; transformers gives the same text (checked above).
                assert ours == text.replace("\u2581", " ")
            else:
                # Lossless: byte-level BPE, or SentencePiece with byte fallback.
                assert ours == text


def test_decode_random_ids(pair: Pair) -> None:
    """Arbitrary id sequences (broken UTF-8, specials anywhere) decode like transformers."""
    rng = random.Random(0)
    n = pair.ours.vocab_size
    for _ in range(200):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert pair.ours.decode(ids, skip) == pair.ref.decode(ids, skip_special_tokens=skip)
    assert pair.ours.convert_ids_to_tokens(list(range(300))) == pair.ref.convert_ids_to_tokens(
        list(range(300))
    )


def test_special_ids(pair: Pair) -> None:
    assert pair.ours.vocab_size == len(pair.ref)
    assert pair.ours.bos_token_id == pair.ref.bos_token_id
    assert pair.ours.eos_token_id == pair.ref.eos_token_id
    assert pair.ours.pad_token_id == pair.ref.pad_token_id
    assert pair.ours.unk_token_id == pair.ref.unk_token_id
    # transformers' Gemma class also names a mask token ("<mask>", its default, not from the
    # file); the four the GGUF names must agree.
    ref_map = {k: v for k, v in pair.ref.special_tokens_map.items() if k != "mask_token"}
    assert pair.ours.special_tokens_map == ref_map


def test_merges_from_vocab_like_transformers() -> None:
    """Merges recovered from a SentencePiece vocabulary (no merges in the file), ties included."""
    from transformers.tokenization_utils_base import generate_merges

    from specdec.model.tokenizer import _merges_from_vocab

    rng = random.Random(3)
    letters = "abcd\u2581"
    tokens = list(dict.fromkeys(letters))
    while len(tokens) < 300:
        word = "".join(rng.choice(letters) for _ in range(rng.randrange(2, 6)))
        if word not in tokens:
            tokens.append(word)
    scores = [float(rng.randrange(-5, 0)) for _ in tokens]  # many ties
    vocab = {t: i for i, t in enumerate(tokens)}
    expected = generate_merges(vocab, dict(zip(tokens, scores)))
    assert _merges_from_vocab(tokens, scores, vocab) == [tuple(m) for m in expected]


def test_end_of_generation_ids(smollm: Pair, gemma: Pair) -> None:
    s = smollm.ours
    # SmolLM2's GGUF: bos = <|im_start|> (1), eos = <|im_end|> (2). <|endoftext|> (0) also ends
    # generation, and so does <reponame> (4), which llama.cpp takes for a fill-in-the-middle token.
    assert s.eos_token_id == s.token_to_id("<|im_end|>") == 2
    assert s.eog_token_ids == frozenset({0, 2, 4})
    g = gemma.ours
    assert g.eos_token_id == g.token_to_id("<eos>") == 1
    assert {1, g.token_to_id("<end_of_turn>")} <= g.eog_token_ids
    # Gemma 3 also has "</s>" (a user-defined token), which llama.cpp counts as end of generation.
    assert g.eog_token_ids == frozenset({1, 106, g.token_to_id("</s>")})


def test_gemma_builds_quickly(gemma: Pair) -> None:
    # 262144 tokens and ~515k merges recovered from the vocabulary: a few seconds, not minutes
    # (generous bound: the machine is shared).
    assert gemma.build_seconds < 30


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template(smollm: Pair, add_generation_prompt: bool) -> None:
    for conversation in (CONVERSATION, CONVERSATION[1:]):  # without a system message the
        # template inserts its default one
        ours = smollm.ours.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt
        )
        ref = smollm.ref.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours == ref
        ours_ids = smollm.ours.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        ref_ids = smollm.ref.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        assert ours_ids == ref_ids
        assert ours_ids.count(smollm.ours.token_to_id("<|im_start|>")) == len(conversation) + (
            conversation[0]["role"] != "system"
        ) + int(add_generation_prompt)


def test_gemma_has_no_chat_template(gemma: Pair) -> None:
    assert gemma.ours.chat_template is None
    with pytest.raises(ValueError, match="model has no chat template"):
        gemma.ours.apply_chat_template(CONVERSATION)
    # transformers refuses too (it has no template to render either).
    with pytest.raises(ValueError):
        gemma.ref.apply_chat_template(CONVERSATION, tokenize=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_with_bos_is_not_doubled(gemma: Pair, add_generation_prompt: bool) -> None:
    conversation = [m for m in CONVERSATION if m["role"] != "system"]
    kwargs = {"chat_template": TURN_TEMPLATE, "add_generation_prompt": add_generation_prompt}
    ours = gemma.ours.apply_chat_template(conversation, **kwargs)
    ref = gemma.ref.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert ours == ref
    assert isinstance(ours, str) and ours.startswith("<bos><start_of_turn>user\n")
    ours_ids = gemma.ours.apply_chat_template(conversation, tokenize=True, **kwargs)
    ref_ids = gemma.ref.apply_chat_template(
        conversation, tokenize=True, return_dict=False, **kwargs
    )
    assert ours_ids == ref_ids
    assert isinstance(ours_ids, list) and ours_ids[:2] == [2, 105]  # <bos><start_of_turn>
    assert ours_ids.count(2) == 1


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streaming_detokenizer_matches_decode(pair: Pair, skip_special_tokens: bool) -> None:
    rng = random.Random(5)
    for text in CORPUS:
        ids = pair.ours.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(pair.ours, [1, 2], skip_special_tokens=skip_special_tokens)
        deltas = []
        pos = 0
        while pos < len(ids):
            step = rng.choice([1, 1, 1, 2, 4])
            deltas.append(detok.add_tokens(ids[pos : pos + step]))
            pos += step
        deltas.append(detok.finalize())
        expected = pair.ref.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.output_text == expected
        assert all("\ufffd" not in d for d in deltas), text  # the corpus is valid UTF-8
