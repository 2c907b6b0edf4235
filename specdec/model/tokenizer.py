"""Tokenizers built from GGUF metadata or a Hugging Face folder, and chat templates.

A GGUF file carries no `tokenizer.json`: it stores the vocabulary, merges, scores and token types
under llama.cpp's key names. We rebuild a `tokenizers.Tokenizer` from them so that token ids match
what Hugging Face transformers produces when it loads the same file
(`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), which is our reference:

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The vocabulary is respelled into the GPT-2
  byte alphabet where needed, the merges come from the file, and the split regex is picked from
  `tokenizer.ggml.pre` (names transformers does not know, like "smollm" or "default", get the
  plain GPT-2 byte-level pre-tokenizer, as transformers does).
* `tokenizer.ggml.model == "llama"`: SentencePiece BPE with byte fallback. When the file has no
  merges they are recovered from the vocabulary. Gemma files get Gemma's pipeline (no prefix space,
  spaces replaced by "\u2581", merges ordered by token position).

Gemma files (no merges) are served by ``_CompactSpm`` instead when the native module
``specdec.model._spm_native`` is built: the same ids and texts as the `tokenizers.Tokenizer` above,
from the vocabulary's bytes in one buffer and a table of ids (~6 MB for Gemma 3's 262,144 tokens,
against ~77 MB for the library's maps, its 515k derived merges and added tokens). The library's
tokenizer is then built only when asked for (``Tokenizer.hf``, ``Tokenizer.to_str``).
``SPECDEC_COMPACT_TOKENIZER=0`` keeps the library's for every file.

Control tokens (type 3) become special added tokens and user-defined tokens (type 4) plain added
tokens, so that they are matched whole in text.

Chat templates are rendered with jinja2 the way transformers renders them.
"""

from __future__ import annotations

import array
import functools
import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from specdec.model.gguf_file import gguf_metadata, read_gguf

try:
    from specdec.model import _spm_native
except ImportError:  # not built: every vocabulary goes through `tokenizers`
    _spm_native = None

__all__ = ["ChatTemplateError", "Tokenizer", "bytes_to_unicode"]

# llama.cpp token types (`llama_token_type` / gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
# Texts the BPE model of a SentencePiece vocabulary remembers, per encoding thread.
# NOTE: these pipelines split no words, so the model's cache (10,000 entries by default) keeps
# whole texts under 256 bytes, each with room for a 32-byte symbol per byte (~8 KB for 250
# bytes): Gemma 3 grew 209 MB over 20,000 distinct 250-character texts on 2 cores (10 MB at
# 256), more with more threads. A memo only: the ids are the same at any size.
SPM_CACHE_CAPACITY = 256

# Split regexes for byte-level BPE, by `tokenizer.ggml.pre`. These are the regexes the models were
# trained with (and the ones transformers' GGUF loader uses); any other name falls back to GPT-2's
# built-in regex inside `pre_tokenizers.ByteLevel`.
_SPLIT_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_SPLIT_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_SPLIT_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _SPLIT_LLAMA3,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _SPLIT_QWEN2),
    "qwen35": _SPLIT_QWEN35,
    "tekken": _SPLIT_TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _SPLIT_GPT4O),
}

_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

# Token texts llama.cpp treats as end of generation (llama-vocab.cpp), whatever the file says.
_EOG_TOKEN_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<turn|>",
    "<|tool_response>",
)
# Fill-in-the-middle tokens llama.cpp also stops on (the first one found of each kind).
_FIM_PAD_NAMES = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_NAMES = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_NAMES = ("<|file_sep|>",)
# An added token written as a marker: <tool_call>, </think>, <|fim_prefix|>, [TOOL_CALLS]
_MARKER = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")


class ChatTemplateError(ValueError):
    """The chat template is missing or failed to render (e.g. it called `raise_exception`)."""


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the byte-level BPE alphabet).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    given the code points 256, 257, ... in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    kept = set(printable)
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in kept:
            mapping[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(mapping.items()))


# --------------------------------------------------------------------------------------------
# Building a `tokenizers.Tokenizer` from GGUF metadata
# --------------------------------------------------------------------------------------------


def _parse_merges(merges: Iterable[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        out.append((left, right))
    return out


def _merges_from_vocab(
    tokens: Sequence[str], ranks: Sequence[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Recover BPE merges from a vocabulary that lists none (SentencePiece GGUFs).

    Every token that can be cut into two tokens of the vocabulary yields one merge per cut. Merges
    are ordered by their token's rank (higher first), then by longer left part, then longer right
    part, then by token order: the order transformers' `generate_merges` produces.
    """
    rank_of: dict[str, float] = {}
    for token, rank in zip(tokens, ranks):
        rank_of[token] = rank  # later duplicates win, keeping the first position (dict semantics)
    known = set(vocab)
    candidates: list[tuple[float, int, int, str, str]] = []
    extend = candidates.extend
    for token, rank in rank_of.items():
        n = len(token)
        # Longest left part first: the tie-breaker within one token.
        extend(
            [
                (rank, cut, n - cut, token[:cut], token[cut:])
                for cut in range(n - 1, 0, -1)
                if token[:cut] in known and token[cut:] in known
            ]
        )
    # Stable sort, descending on (rank, len(left), len(right)); ties keep token order.
    candidates.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    return [(c[3], c[4]) for c in candidates]


def _gemma_merges(tokens: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges for Gemma: ranked by token position in the file (its scores do not follow the merge
    order). Same result as `_merges_from_vocab(tokens, [-i ...])` without the sort."""
    known = set(vocab)
    out: list[tuple[str, str]] = []
    extend = out.extend
    for token in dict.fromkeys(tokens):  # tokens are unique in real files; skip any repeat
        n = len(token)
        if n > 1:
            # Longest left part first: the tie-breaker within one token.
            extend(
                [
                    (token[:cut], token[cut:])
                    for cut in range(n - 1, 0, -1)
                    if token[:cut] in known and token[cut:] in known
                ]
            )
    return out


def _byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], pre: str | None
) -> tokenizers.Tokenizer:
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not alphabet.issuperset(token):
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab[token] = index
    tok = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_parse_merges(merges),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


# A SentencePiece vocabulary's BPE options: unknown pieces fused, bytes as fallback, no dropout,
# the bounded cache.
_SPM_BPE_OPTIONS = {
    "fuse_unk": True,
    "byte_fallback": True,
    "dropout": None,
    "cache_capacity": SPM_CACHE_CAPACITY,
}


def _spm_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], unk_token: str | None = None
) -> models.BPE:
    """A SentencePiece vocabulary's BPE model (_SPM_BPE_OPTIONS)."""
    return models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, **_SPM_BPE_OPTIONS)


def _sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float] | None,
    merges: Sequence[str] | None,
    architecture: str,
    unk_token: str | None,
) -> tokenizers.Tokenizer:
    spm_decoder = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if architecture in _GEMMA_ARCHITECTURES:
        # Gemma files store tokens made of 2+ spaces with real spaces; the model looks them up
        # spelled with "▁" (its normalizer turns every space into "▁").
        tokens = [SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {token: index for index, token in enumerate(tokens)}
        pairs = _parse_merges(merges) if merges else _gemma_merges(tokens, vocab)
        tok = tokenizers.Tokenizer(_spm_bpe(vocab, pairs, unk_token=unk_token or "<unk>"))
        tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
        # A no-op after the normalizer (there are no spaces left), kept to mirror the reference.
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(spm_decoder)
        return tok

    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = _parse_merges(merges)
    else:
        if scores is None:
            raise ValueError("SentencePiece GGUF has neither merges nor scores")
        pairs = _merges_from_vocab(tokens, scores, vocab)
    tok = tokenizers.Tokenizer(_spm_bpe(vocab, pairs))
    if architecture == "phi3":
        # Phi-3 prepends "▁" with a normalizer instead of Metaspace (differs on leading spaces).
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPM_SPACE), normalizers.Replace(" ", SPM_SPACE)]
        )
        tok.decoder = decoders.Sequence([*spm_decoder, decoders.Strip(" ", 1, 0)])
        return tok
    # transformers' LlamaTokenizer: a prefix space on the first word only. It does so whatever
    # `tokenizer.ggml.add_space_prefix` says; we follow it for parity.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="first", split=False
    )
    tok.decoder = decoders.Sequence([*spm_decoder, decoders.Strip(" ", 1, 0)])
    return tok


def _set_added(native: Any, ids: Sequence[int], special: bytes) -> None:
    """``native``'s added tokens: ``ids`` with their special flags; those read as text by
    ``encode_plain_batch`` are ``Tokenizer.control_token_ids`` (the special ones and markers)."""
    flags = sorted(zip(ids, special))
    native.set_added(
        [i for i, _ in flags],
        [bool(sp) for _, sp in flags],
        [bool(sp) or _MARKER.fullmatch(native.id_to_token(i)) is not None for i, sp in flags],
    )


def _restore_compact(
    tokens: list[str],
    unk_id: int,
    unk_token: str,
    added: tuple[array.array, bytes],
    bos_eos: tuple[tuple[str, int] | None, tuple[str, int] | None],
    plain: bool,
) -> _CompactSpm:
    """A pickled ``_CompactSpm`` (``__reduce__``)."""
    native = _spm_native.SpmBpe(tokens, unk_id)
    _set_added(native, *added)
    return _CompactSpm(native, unk_token, added, bos_eos, plain)


class _Encoding(NamedTuple):
    """What `Tokenizer` reads of a `tokenizers.Encoding`."""

    ids: list[int]


class _CompactSpm:
    """Gemma's SentencePiece BPE (the pipeline ``_sentencepiece_bpe`` builds for a vocabulary
    without merges, with its added tokens and BOS / EOS) in the native ``SpmBpe``: the parts of
    the `tokenizers.Tokenizer` interface that `Tokenizer` uses, with the same ids and texts.

    ``hf`` builds the library's tokenizer the slow way (for callers that need the object itself)
    and keeps it; ``to_str`` builds one, serializes it and lets it go."""

    def __init__(
        self,
        native: Any,
        unk_token: str,
        added: tuple[array.array, bytes],  # the added tokens' ids in the order added, special
        bos_eos: tuple[tuple[str, int] | None, tuple[str, int] | None],
        plain: bool = False,
    ) -> None:
        self._native = native
        self._unk_token = unk_token
        # NOTE: ids and flags only (their strings are the vocabulary's at those ids): 6,400
        # tuples of Gemma's strings held ~1 MB
        self._added_ids, self._added_special = added
        self._bos_eos = bos_eos
        self._plain = plain
        self._hf: tokenizers.Tokenizer | None = None
        bos, eos = bos_eos
        self._prefix = [bos[1]] if bos else []
        self._suffix = [eos[1]] if eos else []

    @classmethod
    def build(
        cls,
        tokens: Sequence[str],
        token_types: Sequence[int],
        specials: tuple[str | None, str | None, str | None, str | None],
        add_bos_eos: tuple[bool, bool],
    ) -> _CompactSpm | None:
        """The compact form of what ``from_gguf_metadata`` builds for a Gemma file without
        merges, or None where it would differ from the library's (a repeated token, an added
        token outside the vocabulary, no unknown token): those keep the library's."""
        if _spm_native is None:
            return None
        bos, eos, unk, pad = specials
        unk_token = unk or "<unk>"
        # As _sentencepiece_bpe spells them: runs of spaces with "\u2581"
        spelled = [SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        try:
            native = _spm_native.SpmBpe(spelled, spelled.index(unk_token))
        except ValueError:  # no unknown token, or a token twice (the library keeps the last id)
            return None
        del spelled
        # The added tokens in from_gguf_metadata's order: control (special), user-defined
        # (plain, when the vocabulary has them), then the named specials not yet added.
        added: dict[str, tuple[int, bool]] = {}
        for t, ty in zip(tokens, token_types):
            if ty == TOKEN_TYPE_CONTROL and t not in added:
                index = native.token_to_id(t)
                if index is None:
                    return None
                added[t] = (index, True)
        for t, ty in zip(tokens, token_types):
            if ty == TOKEN_TYPE_USER_DEFINED and t not in added:
                index = native.token_to_id(t)
                if index is not None:
                    added[t] = (index, False)
        for t in (bos, eos, unk, pad):
            if t is not None and t not in added:
                index = native.token_to_id(t)
                if index is None:
                    return None
                added[t] = (index, True)
        if len({i for i, _ in added.values()}) != len(added):
            return None
        add_bos, add_eos = add_bos_eos
        bos_eos = (
            (bos, added[bos][0]) if add_bos and bos is not None else None,
            (eos, added[eos][0]) if add_eos and eos is not None else None,
        )
        compact_added = (
            array.array("i", [i for i, _ in added.values()]),
            bytes(special for _, special in added.values()),
        )
        _set_added(native, *compact_added)
        return cls(native, unk_token, compact_added, bos_eos)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its vocabulary and settings (the native tables are rebuilt)."""
        tokens = [self._native.id_to_token(i) for i in range(len(self._native))]
        unk_id = self._native.token_to_id(self._unk_token)
        added = (self._added_ids, self._added_special)
        return _restore_compact, (
            tokens,
            unk_id,
            self._unk_token,
            added,
            self._bos_eos,
            self._plain,
        )

    def _added(self) -> list[tuple[str, int, bool]]:
        """The added tokens (content, id, special), in the order added."""
        token = self._native.id_to_token
        return [
            (token(i), i, bool(special)) for i, special in zip(self._added_ids, self._added_special)
        ]

    def plain(self) -> _CompactSpm:
        """The same tokenizer reading the control tokens' strings as text (one vocabulary)."""
        added = (self._added_ids, self._added_special)
        return _CompactSpm(self._native, self._unk_token, added, self._bos_eos, plain=True)

    # ---- the `tokenizers.Tokenizer` interface `Tokenizer` uses ------------------------------

    def token_to_id(self, token: str) -> int | None:
        return self._native.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self._native.id_to_token(index)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._native)  # every added token is one of the vocabulary's

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return {
            i: AddedToken(t, normalized=False, special=special)
            for t, i, special in sorted(self._added(), key=lambda a: a[1])
        }

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[_Encoding]:
        out = self._native.encode_batch(list(texts), self._plain)
        if add_special_tokens and (self._prefix or self._suffix):
            return [_Encoding(self._prefix + ids + self._suffix) for ids in out]
        return [_Encoding(ids) for ids in out]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._native.decode(ids, skip_special_tokens)

    def max_token_chars(self) -> int:
        return self._native.max_token_chars() or 1

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The library's tokenizer for the same vocabulary (built on first use, ~2 s and ~77 MB
        for Gemma 3, then kept)."""
        if self._hf is None:
            self._hf = self._build_hf()
        return self._hf

    def to_str(self) -> str:
        """The library's JSON for this tokenizer (from a copy built for it and dropped)."""
        if self._hf is not None:
            return self._hf.to_str()
        return self._build_hf().to_str()

    def _build_hf(self) -> tokenizers.Tokenizer:
        tokens = [self._native.id_to_token(i) for i in range(len(self._native))]
        hf = _sentencepiece_bpe(tokens, None, None, "gemma3", self._unk_token)
        del tokens
        # NOTE: in runs of one kind, as from_gguf_metadata adds them (one call a token rebuilt
        # the matcher each time: 6,400 tokens took ~10 s)
        for special, run in itertools.groupby(self._added(), key=lambda a: a[2]):
            tokens = [AddedToken(c, normalized=False, special=special) for c, _, _ in run]
            if special:
                hf.add_special_tokens(tokens)
            else:
                hf.add_tokens(tokens)
        hf.post_processor = _template_post_processor(*self._bos_eos)
        if self._plain:
            hf.encode_special_tokens = True
        return hf


def _template_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """BOS/EOS around the text, as transformers' `update_post_processor` sets it up."""
    b = f"{bos[0]}:0 " if bos else ""
    e = f" {eos[0]}:0" if eos else ""
    single = f"{b}$A:0{e}"
    b1 = f" {bos[0]}:1" if bos else ""
    e1 = f" {eos[0]}:1" if eos else ""
    pair = f"{single}{b1} $B:1{e1}"
    specials = list(dict.fromkeys(t for t in (bos, eos) if t is not None))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _token_id(value: Any) -> int | None:
    if value is None:
        return None
    value = int(value)
    return value if value >= 0 else None


def _end_of_generation_ids(
    hf: tokenizers.Tokenizer, explicit: Iterable[int | None], fim_ids: dict[str, int | None]
) -> frozenset[int]:
    """Ids that end generation, the way llama.cpp collects them: EOS/EOT/EOM, the fill-in-the-middle
    pad/repo/separator tokens, and every token whose text is a known end-of-turn marker."""
    eog: set[int] = set()
    for kind, names in (("pad", _FIM_PAD_NAMES), ("rep", _FIM_REP_NAMES), ("sep", _FIM_SEP_NAMES)):
        found = fim_ids.get(kind)
        if found is None:
            present = [i for i in (hf.token_to_id(n) for n in names) if i is not None]
            found = min(present) if present else None
        if found is not None:
            eog.add(found)
    by_name: dict[str, int] = {}
    for name in _EOG_TOKEN_NAMES:
        index = hf.token_to_id(name)
        if index is not None:
            by_name[name] = index
            eog.add(index)
    eog.update(i for i in explicit if i is not None)
    # llama.cpp's workarounds: gpt-oss / solar-open use "<|end|>" mid-answer, gemma4 uses "</s>".
    if "<|end|>" in by_name and (
        {"<|return|>", "<|call|>"} <= by_name.keys() or {"<|calls|>", "<|flush|>"} <= by_name.keys()
    ):
        eog.discard(by_name["<|end|>"])
    if "<|tool_response>" in by_name and "</s>" in by_name:
        eog.discard(by_name["</s>"])
    return frozenset(eog)


# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (used to mark assistant text for training
    masks) and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own `tojson`, no HTML escaping: templates emit JSON for the model to read.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def chat_template_environment(
    env_class: type[ImmutableSandboxedEnvironment] = ImmutableSandboxedEnvironment,
) -> ImmutableSandboxedEnvironment:
    """A jinja environment set up as transformers sets up chat templates' (its filters,
    globals and ``{% generation %}`` blocks), of ``env_class`` (a sandbox, or a stricter one)."""
    env = env_class(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile_chat_template(source: str) -> jinja2.Template:
    return chat_template_environment().from_string(source)


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def prepare_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy the messages, dropping None values (as transformers does: templates handle a missing
    key better than a literal None) and mirroring reasoning text under the names templates read."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
        msg = {k: v for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_KEYS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: special ids, EOG ids, chat template."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_eog_token_ids: Iterable[int] = (),
        fim_token_ids: dict[str, int | None] | None = None,
    ) -> None:
        """Wrap `hf`, whose post-processor already decides whether BOS/EOS are added."""
        self._hf = hf
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.bos_token_id: int | None = self._id_of(bos_token)
        self.eos_token_id: int | None = self._id_of(eos_token)
        self.unk_token_id: int | None = self._id_of(unk_token)
        self.pad_token_id: int | None = self._id_of(pad_token)
        self.chat_template: str | None = chat_template
        self.eog_token_ids: frozenset[int] = _end_of_generation_ids(
            hf, [self.eos_token_id, *extra_eog_token_ids], fim_token_ids or {}
        )
        # Added tokens marked special: what `decode(..., skip_special_tokens=True)` drops.
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in hf.get_added_tokens_decoder().items() if t.special
        )
        # SentencePiece byte-fallback tokens "<0x00>".."<0xFF>" (none in byte-level vocabularies).
        byte_ids = (hf.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self.byte_fallback_token_ids: frozenset[int] = frozenset(
            i for i in byte_ids if i is not None
        )
        probe = hf.encode("", add_special_tokens=True).ids
        self.add_bos_token: bool = bool(probe) and probe[0] == self.bos_token_id
        rest = probe[1:] if self.add_bos_token else probe
        self.add_eos_token: bool = bool(rest) and rest[-1] == self.eos_token_id

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._hf.token_to_id(token)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], compact: bool | None = None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (see `gguf_file.gguf_metadata`).

        ``compact``: a Gemma vocabulary without merges goes to ``_CompactSpm`` where the native
        module is built (False: always the `tokenizers` library's, the reference; None: as
        ``$SPECDEC_COMPACT_TOKENIZER`` says, on unless ``0`` / ``off``)."""
        if compact is None:
            compact = os.environ.get("SPECDEC_COMPACT_TOKENIZER", "").lower() not in ("0", "off")
        kind = metadata.get("tokenizer.ggml.model")
        tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
        merges = metadata.get("tokenizer.ggml.merges")
        architecture = str(metadata.get("general.architecture", ""))

        def token_at(key: str) -> str | None:
            index = _token_id(metadata.get(f"tokenizer.ggml.{key}"))
            return tokens[index] if index is not None and index < len(tokens) else None

        bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
        unk, pad = token_at("unknown_token_id"), token_at("padding_token_id")

        add_bos_default = kind == "llama"  # llama.cpp adds BOS to a SentencePiece vocabulary
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        extra_eog = [
            _token_id(metadata.get(f"tokenizer.ggml.{k}")) for k in ("eot_token_id", "eom_token_id")
        ]
        fim = {
            kind_: _token_id(metadata.get(f"tokenizer.ggml.fim_{kind_}_token_id"))
            for kind_ in ("pad", "rep", "sep")
        }
        template = metadata.get("tokenizer.chat_template")
        chat_template = str(template) if template else None
        if compact and kind == "llama" and architecture in _GEMMA_ARCHITECTURES and not merges:
            small = _CompactSpm.build(tokens, token_types, (bos, eos, unk, pad), (add_bos, add_eos))
            if small is not None:
                return cls(
                    small,  # type: ignore[arg-type]  # the interface Tokenizer uses
                    bos_token=bos,
                    eos_token=eos,
                    unk_token=unk,
                    pad_token=pad,
                    chat_template=chat_template,
                    extra_eog_token_ids=[i for i in extra_eog if i is not None],
                    fim_token_ids=fim,
                )

        if kind == "gpt2":
            hf = _byte_level_bpe(tokens, merges or [], metadata.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            hf = _sentencepiece_bpe(
                tokens, metadata.get("tokenizer.ggml.scores"), merges, architecture, unk
            )
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer {kind!r} (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece)"
            )

        byte_level = kind == "gpt2"
        alphabet = set(bytes_to_unicode().values()) if byte_level else None
        model = hf.model  # NOTE: its lookups, not get_vocab's dict of every token (0.2 s for Gemma)
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, token_types)
            if ty == TOKEN_TYPE_CONTROL and (alphabet is None or alphabet.issuperset(t))
        ]
        if control:
            hf.add_special_tokens(control)
        user_defined = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, token_types)
            if ty == TOKEN_TYPE_USER_DEFINED and model.token_to_id(t) is not None
        ]
        if user_defined:
            hf.add_tokens(user_defined)

        return cls._wrap(
            hf, (bos, eos, unk, pad), (add_bos, add_eos),
            chat_template=chat_template,
            extra_eog_token_ids=[i for i in extra_eog if i is not None],
            fim_token_ids=fim,
        )  # fmt: skip

    @classmethod
    def from_gguf_file(cls, path: str | Path) -> Tokenizer:
        """Read a GGUF file's metadata and build its tokenizer."""
        return cls.from_gguf_metadata(gguf_metadata(read_gguf(path)))

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, with `tokenizer_config.json` (special tokens, add_bos/add_eos,
        chat template) and `generation_config.json` (extra EOS ids) when present."""
        folder = Path(path)
        if folder.is_file():
            folder = folder.parent
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found")
        hf = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")

        def special(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            if isinstance(value, dict):
                value = value.get("content")
            return value if isinstance(value, str) else None

        bos, eos = special("bos_token"), special("eos_token")
        unk, pad = special("unk_token"), special("pad_token")
        # As in transformers: an explicit add_bos_token/add_eos_token (or no post-processor at
        # all) rebuilds the post-processor; otherwise tokenizer.json's own one is kept.
        add_bos_eos = None
        if "add_bos_token" in config or "add_eos_token" in config or hf.post_processor is None:
            add_bos_eos = (
                bool(config.get("add_bos_token", False)),
                bool(config.get("add_eos_token", False)),
            )

        # generation_config.json may list several EOS ids (e.g. Llama 3: <|end_of_text|>,
        # <|eom_id|>, <|eot_id|>); generation stops on any of them.
        value = _read_json(folder / "generation_config.json").get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        extra_eog = [int(v) for v in values if isinstance(v, int)]
        return cls._wrap(
            hf, (bos, eos, unk, pad), add_bos_eos,
            chat_template=_hf_chat_template(folder, config),
            extra_eog_token_ids=extra_eog,
        )  # fmt: skip

    @classmethod
    def _wrap(
        cls,
        hf: tokenizers.Tokenizer,
        specials: tuple[str | None, str | None, str | None, str | None],  # bos, eos, unk, pad
        add_bos_eos: tuple[bool, bool] | None,
        chat_template: str | None,
        extra_eog_token_ids: Iterable[int],
        fim_token_ids: dict[str, int | None] | None = None,
    ) -> Tokenizer:
        """The loaders' common end: ``specials`` added to ``hf`` (``_add_named_specials``), its
        post-processor rebuilt to add BOS / EOS as ``add_bos_eos`` says (None: ``hf``'s own
        kept), and the result wrapped."""
        bos, eos, unk, pad = specials
        _add_named_specials(hf, specials)
        if add_bos_eos is not None:
            add_bos, add_eos = add_bos_eos
            hf.post_processor = _template_post_processor(
                (bos, hf.token_to_id(bos)) if add_bos and bos is not None else None,
                (eos, hf.token_to_id(eos)) if add_eos and eos is not None else None,
            )
        return cls(
            hf,
            bos_token=bos,
            eos_token=eos,
            unk_token=unk,
            pad_token=pad,
            chat_template=chat_template,
            extra_eog_token_ids=extra_eog_token_ids,
            fim_token_ids=fim_token_ids,
        )

    # ---- encoding / decoding ---------------------------------------------------------------

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`.

        NOTE: a compact tokenizer (``compact``) builds one on first use and keeps it (~77 MB and
        ~2 s for Gemma 3): what needs the library's description only should use ``to_str``."""
        if isinstance(self._hf, _CompactSpm):
            return self._hf.hf
        return self._hf

    @property
    def compact(self) -> bool:
        """Whether the native compact SentencePiece tokenizer serves this vocabulary (Gemma's)
        rather than a `tokenizers.Tokenizer`."""
        return isinstance(self._hf, _CompactSpm)

    def to_str(self) -> str:
        """The `tokenizers` JSON of this tokenizer (what ``tokenizers.Tokenizer.from_str`` and
        llguidance read); a compact tokenizer builds the library's for it and drops it."""
        return self._hf.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model's config says.

        NOTE: through ``encode_batch``, which releases the GIL while it works (``encode`` holds
        it: a 3 MB prompt stalled every other thread, the server's event loop included, 4 s)."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` for several texts at once (parallel in Rust). A text that is not valid
        Unicode (a lone surrogate) is a ValueError naming the character's position."""
        for text in texts:
            _check_unicode(text)
        encs = self._hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    # ---- special-token strings in text ---------------------------------------------------
    # NOTE: the tokenizer matches added tokens in the raw text first (leftmost-longest) and
    # tokenizes the text between them on its own; these mirror that split for the control ones.

    @functools.cached_property
    def control_token_ids(self) -> frozenset[int]:
        """The added tokens that steer the model rather than spell text: the special ones, and
        those written as markers (``<tool_call>``, ``</think>``, ``<|fim_prefix|>``, ``[TOOL]``)
        that vocabularies add without the special flag, which the tokenizer matches in any text
        all the same."""
        return self.special_token_ids | frozenset(
            i
            for i, t in self._hf.get_added_tokens_decoder().items()
            if _MARKER.fullmatch(t.content)
        )

    @functools.cached_property
    def special_token_pattern(self) -> re.Pattern[str] | None:
        """A regex matching the control tokens' strings (leftmost-longest), None if none."""
        decoder = self._hf.get_added_tokens_decoder()
        strings = [t.content for i, t in decoder.items() if i in self.control_token_ids]
        return _literal_regex(strings) if strings else None

    @functools.cached_property
    def _plain_hf(self) -> tokenizers.Tokenizer:
        """A second tokenizer over the same model that reads the control tokens' strings as
        text (``encode_plain_batch``).

        NOTE: it shares the model with ``_hf`` (no second vocabulary: a copy through
        ``to_str`` / ``from_str`` held Gemma 3's 262k tokens and 515k merges twice, +97 MB, and
        took 2-5 s to build); only the added tokens are its own, the control ones flagged special
        (``encode_special_tokens`` reads only those as text)."""
        hf = self._hf
        if isinstance(hf, _CompactSpm):
            return hf.plain()  # type: ignore[return-value]  # the interface used here
        plain = tokenizers.Tokenizer(hf.model)
        # NOTE: the normalizer before the added tokens, as from_str does (normalized ones are
        # matched in their normalized form)
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            value = getattr(hf, part)
            if value is not None:
                setattr(plain, part, value)
        if hf.truncation is not None:
            plain.enable_truncation(**hf.truncation)
        if hf.padding is not None:
            plain.enable_padding(**hf.padding)
        want = {
            i: _added_token(t, special=t.special or i in self.control_token_ids)
            for i, t in hf.get_added_tokens_decoder().items()
        }
        plain.add_tokens([want[i] for i in sorted(want)])  # ids assigned in order, as from_str
        if plain.get_added_tokens_decoder() != want:  # never seen (== compares every flag)
            plain = self._plain_hf_copy()
        plain.encode_special_tokens = True  # control-token strings are text to this copy
        return plain

    def _plain_hf_copy(self) -> tokenizers.Tokenizer:
        """``_plain_hf`` through a serialized copy of the whole tokenizer (its model too)."""
        data = json.loads(self._hf.to_str())
        for token in data.get("added_tokens", []):
            if token.get("id") in self.control_token_ids:
                # NOTE: encode_special_tokens reads only tokens flagged special as text
                token["special"] = True
        return tokenizers.Tokenizer.from_str(json.dumps(data))

    def find_special_token(self, text: str) -> tuple[int, int] | None:
        """The first control token's string in `text` (``control_token_ids``): its (id, start),
        or None."""
        found = self.special_token_pattern.search(text) if self.special_token_pattern else None
        if found is None:
            return None
        token_id = self._hf.token_to_id(found.group())
        assert token_id is not None
        return token_id, found.start()

    def split_special_tokens(self, text: str) -> list[str | int]:
        """`text` split as the tokenizer splits it: the control tokens' ids and the text between
        them (no empty strings)."""
        if self.special_token_pattern is None:
            return [text] if text else []
        out: list[str | int] = []
        start = 0
        for m in self.special_token_pattern.finditer(text):
            if m.start() > start:
                out.append(text[start : m.start()])
            token_id = self._hf.token_to_id(m.group())
            assert token_id is not None
            out.append(token_id)
            start = m.end()
        if start < len(text):
            out.append(text[start:])
        return out

    def encode_plain_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode_batch` reading control-token strings as plain text: ``"<|im_start|>"`` or
        ``"<tool_call>"`` in `texts` is the tokens of those characters, never the token
        (transformers' ``split_special_tokens=True``, extended to the unflagged markers). BOS/EOS
        are still added as `add_special_tokens` says."""
        for text in texts:
            _check_unicode(text)
        encs = self._plain_hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; incomplete UTF-8 at either end shows as U+FFFD."""
        return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> list[str]:
        """Vocabulary strings of the ids (as spelled in the vocab, e.g. "Ġthe" or "▁the")."""
        if isinstance(ids, int):
            ids = [ids]
        out: list[str] = []
        for i in ids:
            token = self._hf.id_to_token(int(i))
            if token is None:
                raise IndexError(f"token id {i} out of range (vocab size {self.vocab_size})")
            out.append(token)
        return out

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None."""
        return self._hf.token_to_id(token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (bos/eos/unk/pad) that are set, as template variables."""
        named = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {k: v for k, v in named.items() if v is not None}

    # ---- chat ------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers does.

        `extra` becomes template variables (e.g. `tools=[...]`, `enable_thinking=False`); a
        `chat_template=` entry overrides the model's template. With `tokenize=True` the rendered
        text is encoded without adding special tokens: the template writes BOS itself if the model
        wants one.
        """
        template = extra.pop("chat_template", None) or self.chat_template
        if not template:
            raise ChatTemplateError(
                "model has no chat template (tokenizer.chat_template is missing, as in base "
                "models): send a plain-text completion prompt instead, or pass chat_template="
            )
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        variables: dict[str, Any] = {
            "tools": None,
            "documents": None,
            **self.special_tokens_map,
            **extra,
        }
        try:
            rendered = _compile_chat_template(template).render(
                messages=prepare_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (OverflowError, RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e
        if tokenize:
            return self.encode(rendered, add_special_tokens=False)
        return rendered

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, eog={sorted(self.eog_token_ids)}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )


def _add_named_specials(hf: tokenizers.Tokenizer, named: Iterable[str | None]) -> None:
    """Make sure the named special tokens exist as added tokens (special unless already added)."""
    present = {t.content for t in hf.get_added_tokens_decoder().values()}
    missing: list[AddedToken] = []
    for token in named:
        if token is not None and token not in present:
            missing.append(AddedToken(token, normalized=False, special=True))
            present.add(token)
    if missing:
        hf.add_special_tokens(missing)


_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(token: AddedToken, special: bool | None = None) -> AddedToken:
    """A copy of ``token``, its ``special`` flag replaced when given."""
    flags = {name: getattr(token, name) for name in _ADDED_TOKEN_FLAGS}
    if special is not None:
        flags["special"] = special
    return AddedToken(token.content, **flags)


def _literal_regex(strings: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any of `strings`, the longest at a position first, built as a trie (an
    alternation of thousands of strings, as Gemma's special tokens, is slow to search)."""
    trie: dict[str, Any] = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict[str, Any]) -> str:
        ends = "" in node
        branches = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends:
            return f"(?:{body})?"
        return body

    return re.compile(pattern(trie))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json or tokenizer_config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = _read_json(folder / "chat_template.json").get("chat_template")
    if value is None:
        value = config.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _check_unicode(text: str) -> None:
    """ValueError where ``text`` holds a lone surrogate (no UTF-8 for it: the tokenizer's own
    error is a TypeError that names nothing)."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the text holds a lone surrogate (U+{ord(text[e.start]):04X}) at character "
            f"{e.start}: not valid Unicode"
        ) from None


def max_token_chars(hf: Any) -> int:
    """The most characters one token of ``hf`` (a `Tokenizer` or a ``tokenizers.Tokenizer``)
    can spell: its longest vocabulary string (a byte-level or SentencePiece string is at least as
    long as the text it decodes to)."""
    if isinstance(hf, Tokenizer):
        hf = hf._hf
    if isinstance(hf, _CompactSpm):
        return hf.max_token_chars()
    return max((len(s) for s in hf.get_vocab(with_added_tokens=True)), default=1) or 1
