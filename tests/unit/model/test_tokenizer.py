"""Tokenizer built from tiny hand-made GGUF metadata and HF folders (fast, no model files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specdec.model.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    _merges_from_vocab,
    bytes_to_unicode,
)
from tests.fixtures.tokenizers import (
    CHATML,
    byte_level_metadata,
    sentencepiece_metadata,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(byte_level_metadata())


def test_bytes_to_unicode_is_gpt2_alphabet() -> None:
    mapping = bytes_to_unicode()
    assert len(mapping) == 256 and len(set(mapping.values())) == 256
    assert mapping[ord("a")] == "a"
    assert mapping[ord(" ")] == "Ġ"
    assert mapping[ord("\n")] == "Ċ"
    assert mapping[0] == chr(256)


def test_encode_applies_merges(tok: Tokenizer) -> None:
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["hello", "Ġworld"]
    assert tok.convert_ids_to_tokens(ids[0]) == ["hello"]
    assert tok.decode(ids) == "hello world"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello the world",
        "Café naïve — “quoted”",
        "日本語 中文 한국어",
        "emoji 😀👍🏽👨‍👩‍👧 🇫🇷",
        "tabs\tand\nnewlines\r\n  runs   of    spaces  ",
        "def f(x):\n    return x ** 2  # code\n",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_multibyte_character_is_byte_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) == 4  # no merges for it: one token per UTF-8 byte
    assert tok.decode(ids[:2]) == "\ufffd"  # incomplete UTF-8 decodes as a replacement char
    assert tok.decode(ids) == "😀"


def test_special_tokens_are_matched_whole(tok: Tokenizer) -> None:
    text = "<|im_start|>user\nhello<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tok.token_to_id("<|im_end|>") == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello"


def test_user_defined_token_is_added_but_not_special(tok: Tokenizer) -> None:
    think = tok.token_to_id("<think>")
    assert think is not None
    ids = tok.encode("a<think>b")
    assert think in ids
    # Not special: kept by skip_special_tokens.
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b"


def test_special_ids_and_attributes(tok: Tokenizer) -> None:
    assert tok.bos_token_id == 3 and tok.bos_token == "<s>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.unk_token_id == 0 and tok.pad_token_id == 0
    assert tok.vocab_size == len(byte_level_metadata()["tokenizer.ggml.tokens"])
    assert tok.add_bos_token is False
    assert tok.byte_fallback_token_ids == frozenset()
    assert tok.hf.get_vocab_size() == tok.vocab_size


def test_eog_includes_end_of_turn_tokens(tok: Tokenizer) -> None:
    # eos (<|im_end|>) plus <|endoftext|>, which llama.cpp also treats as end of generation.
    assert tok.eog_token_ids == frozenset({0, 2})


def test_eog_from_gguf_keys_and_fim_names() -> None:
    meta = byte_level_metadata()
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<|eot_id|>", "<fim_pad>"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [3, 3]
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.eom_token_id"] = 1
    t = Tokenizer.from_gguf_metadata(meta)
    assert t.eog_token_ids == frozenset({0, 1, 2, n - 2, n - 1})


def test_eos_not_im_end() -> None:
    # A file whose EOS is <|endoftext|> still stops on <|im_end|> (SmolLM-style chat models).
    t = Tokenizer.from_gguf_metadata(byte_level_metadata(**{"tokenizer.ggml.eos_token_id": 0}))
    assert t.eos_token_id == 0
    assert {0, 2} <= t.eog_token_ids


def test_add_bos_and_eos() -> None:
    t = Tokenizer.from_gguf_metadata(
        byte_level_metadata(
            **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
        )
    )
    assert t.add_bos_token and t.add_eos_token
    assert t.encode("hello") == [3, t.token_to_id("hello"), 2]
    assert t.encode("hello", add_special_tokens=False) == [t.token_to_id("hello")]
    assert t.decode(t.encode("hello"), skip_special_tokens=False) == "<s>hello<|im_end|>"
    assert t.decode(t.encode("hello")) == "hello"


def test_known_pre_tokenizer_names_use_their_split_regex() -> None:
    plain = Tokenizer.from_gguf_metadata(byte_level_metadata())
    llama3 = Tokenizer.from_gguf_metadata(
        byte_level_metadata(**{"tokenizer.ggml.pre": "llama-bpe"})
    )
    qwen2 = Tokenizer.from_gguf_metadata(byte_level_metadata(**{"tokenizer.ggml.pre": "qwen2"}))
    text = "12345 abc"
    split = [w for w, _ in llama3.hf.pre_tokenizer.pre_tokenize_str(text)]
    assert split == ["123", "45", "Ġabc"]  # llama-3 groups digits by three
    split = [w for w, _ in qwen2.hf.pre_tokenizer.pre_tokenize_str(text)]
    assert split == ["1", "2", "3", "4", "5", "Ġabc"]  # qwen2 splits every digit
    split = [w for w, _ in plain.hf.pre_tokenizer.pre_tokenize_str(text)]
    assert split == ["12345", "Ġabc"]  # GPT-2's regex
    for t in (plain, llama3, qwen2):
        assert t.decode(t.encode("x 12345 y")) == "x 12345 y"


def test_unsupported_model_type() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer"):
        Tokenizer.from_gguf_metadata(byte_level_metadata(**{"tokenizer.ggml.model": "rwkv"}))


# ---- SentencePiece (tokenizer.ggml.model == "llama") ------------------------------------------


def test_gemma_sentencepiece() -> None:
    t = Tokenizer.from_gguf_metadata(sentencepiece_metadata("gemma3"))
    ids = t.encode("hello world")
    assert ids[0] == t.bos_token_id == 2
    assert t.convert_ids_to_tokens(ids[1:]) == ["hello", "▁world"]  # no prefix space
    assert t.decode(ids) == "hello world"
    # Two spaces: the file spells that token "  ", the model looks it up as "▁▁".
    assert t.convert_ids_to_tokens(t.encode("  ", add_special_tokens=False)) == ["▁▁"]
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    ids = t.encode("h€", add_special_tokens=False)
    assert t.convert_ids_to_tokens(ids) == ["h", "<0xE2>", "<0x82>", "<0xAC>"]
    assert t.decode(ids) == "h€"
    assert len(t.byte_fallback_token_ids) == 256
    assert t.eog_token_ids == frozenset({1, 4})  # <eos> and <end_of_turn>


def test_llama_sentencepiece_prefix_space() -> None:
    t = Tokenizer.from_gguf_metadata(sentencepiece_metadata("llama"))
    ids = t.encode("hello world", add_special_tokens=False)
    assert t.convert_ids_to_tokens(ids) == ["▁hello", "▁world"]
    assert t.decode(ids) == "hello world"  # the prefix space is stripped again


def test_merges_from_vocab_order() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc", "cab"]
    ranks = [0.0, 0.0, 0.0, -1.0, -1.0, -2.0, -1.0]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges_from_vocab(tokens, ranks, vocab)
    # Best rank first; within a rank, longer left part first, then token order.
    assert merges == [("c", "ab"), ("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


# ---- chat templates --------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "again"},
]


def test_chat_template_rendering(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\nhello world<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert isinstance(no_prompt, str) and no_prompt.endswith("again<|im_end|>\n")


def test_chat_template_tokenize_adds_no_second_bos() -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    t = Tokenizer.from_gguf_metadata(
        byte_level_metadata(
            **{"tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": template}
        )
    )
    ids = t.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    assert ids == [t.bos_token_id, t.token_to_id("hello")]
    assert t.encode("hello")[0] == t.bos_token_id  # plain encode does add it


def test_chat_template_hf_environment(tok: Tokenizer) -> None:
    template = (
        "{%- for m in messages -%}\n"
        "  {%- if m['role'] == 'skip' %}{% continue %}{% endif -%}\n"
        "  {%- generation %}[{{ m['role'] }}|{{ m | tojson }}]{% endgeneration -%}\n"
        "{%- endfor %}\n"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ custom }}"
    )
    messages = [
        {"role": "user", "content": '<b>é</b> & "q"', "name": None},
        {"role": "skip", "content": "x"},
    ]
    out = tok.apply_chat_template(messages, chat_template=template, custom="v", tools=[{"a": 1}])
    # tojson does not HTML-escape and keeps non-ASCII; None-valued keys are dropped.
    assert out == (
        '[user|{"role": "user", "content": "<b>é</b> & \\"q\\""}]'
        '[\n  {\n    "a": 1\n  }\n]<|im_end|>|4|v'
    )


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.apply_chat_template(CONVERSATION, chat_template=template)


def test_chat_template_sandbox(tok: Tokenizer) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(CONVERSATION, chat_template=template)


def test_no_chat_template_is_a_clear_error() -> None:
    t = Tokenizer.from_gguf_metadata(sentencepiece_metadata("gemma3"))
    assert t.chat_template is None
    with pytest.raises(ValueError, match="model has no chat template"):
        t.apply_chat_template(CONVERSATION)


def test_empty_conversation(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])


# ---- Hugging Face folders --------------------------------------------------------------------


def write_hf_folder(folder: Path, source: Tokenizer, config: dict[str, Any]) -> None:
    source.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 1], "bos_token_id": 3}), encoding="utf-8"
    )


def test_from_hf_folder(tmp_path: Path, tok: Tokenizer) -> None:
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "pad_token": None,
        "add_bos_token": True,
        "chat_template": CHATML,
    }
    write_hf_folder(tmp_path, tok, config)
    t = Tokenizer.from_hf_folder(tmp_path)
    assert t.bos_token_id == 3 and t.eos_token_id == 0 and t.pad_token_id is None
    assert t.add_bos_token
    assert t.encode("hello") == [3, t.token_to_id("hello")]
    assert t.chat_template == CHATML
    # eos, generation_config's eos list (2 = <|im_end|>, 1 = <|im_start|>) and name-based EOG ids.
    assert t.eog_token_ids == frozenset({0, 1, 2})
    assert t.apply_chat_template(CONVERSATION[:2], tokenize=True) == tok.apply_chat_template(
        CONVERSATION[:2], tokenize=True
    )


def test_from_hf_folder_named_templates_and_jinja_file(tmp_path: Path, tok: Tokenizer) -> None:
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    write_hf_folder(tmp_path, tok, config)
    t = Tokenizer.from_hf_folder(tmp_path)
    assert t.chat_template == "D"
    assert t.add_bos_token is False  # tokenizer.json's post-processor kept
    (tmp_path / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "J"


def test_from_hf_folder_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_hf_folder(tmp_path)


# ---- memory ----------------------------------------------------------------------------------


def _hf_folder_with_added_tokens(folder: Path, tok: Tokenizer) -> Tokenizer:
    """A tokenizer.json folder whose added tokens carry every flag, some past the model's ids,
    with truncation and padding set."""
    data = json.loads(tok.hf.to_str())
    top = max(t["id"] for t in data["added_tokens"])
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    data["added_tokens"] += [
        {"id": top + 1, "content": "<tool_call>", **flags, "lstrip": True, "special": False},
        {"id": top + 2, "content": " he", **flags, "normalized": True, "special": False},
        {"id": top + 3, "content": "[MARK]", **flags, "single_word": True, "special": True},
    ]
    data["truncation"] = {"max_length": 512, "stride": 0, "strategy": "LongestFirst"}
    data["truncation"]["direction"] = "Right"
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return Tokenizer.from_hf_folder(folder)


@pytest.mark.parametrize("source", ["byte_level", "gemma3", "gemma3-library", "llama", "hf_folder"])
def test_plain_encoding_shares_the_model(source: str, tmp_path: Path, tok: Tokenizer) -> None:
    """``encode_plain_batch``'s tokenizer reads the same model as ``encode`` (a vocabulary is
    held once, however large), and encodes what a serialized copy with the control tokens
    flagged special encodes."""
    if source == "byte_level":
        t = tok
    elif source == "hf_folder":
        t = _hf_folder_with_added_tokens(tmp_path, tok)
    elif source == "gemma3-library":
        t = Tokenizer.from_gguf_metadata(sentencepiece_metadata("gemma3"), compact=False)
        assert not t.compact
    else:
        t = Tokenizer.from_gguf_metadata(sentencepiece_metadata(source))
    copy = t._plain_hf_copy()
    copy.encode_special_tokens = True
    added = [a.content for a in t.hf.get_added_tokens_decoder().values()]
    texts = ["hello world", "  hello  world ", "h€llo\nworld", *added]
    texts += [f"{a}hello{b} world{a}" for a in added for b in added[:3]]
    for special in (True, False):
        ours = t.encode_plain_batch(texts, add_special_tokens=special)
        assert ours == [e.ids for e in copy.encode_batch(texts, add_special_tokens=special)]
    assert t._plain_hf.get_added_tokens_decoder() == copy.get_added_tokens_decoder()
    if t.compact:  # one native vocabulary behind both (no library objects to compare)
        assert t._plain_hf._native is t._hf._native
        return
    assert t._plain_hf.truncation == copy.truncation
    model = t.hf.model
    model.unk_token, unk = "<changed>", model.unk_token
    try:
        assert t._plain_hf.model.unk_token == "<changed>"  # one model, seen through both
    finally:
        model.unk_token = unk


def _resident_bytes() -> int:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # NOTE: freed heap back to the system before each reading
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc and glibc (Linux)")
def test_sentencepiece_model_remembers_few_texts() -> None:
    """A SentencePiece pipeline hands the BPE model whole texts, which its cache keeps with ~32
    bytes a byte (10,000 of them by default: ~24 MB here for 3,000 texts of 250 characters, in
    each encoding thread); SPM_CACHE_CAPACITY bounds it (~2 MB)."""
    import random

    t = Tokenizer.from_gguf_metadata(sentencepiece_metadata("gemma3"), compact=False)
    rnd = random.Random(0)
    texts = ["".join(rnd.choice("helowrd") for _ in range(250)) for _ in range(3000)]
    before = _resident_bytes()
    for text in texts:
        t.hf.encode(text)  # NOTE: on this thread (encode_batch spreads texts over a pool)
    assert _resident_bytes() - before < 12 * 2**20
