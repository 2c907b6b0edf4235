"""``bad_words`` (vLLM's): token sequences whose last token is banned wherever the output so far
ends with the rest of the sequence (a one-token word: everywhere).

A request's words are tokenized and indexed once, where the request is prepared (the server's
preparation pool, not the engine thread): a trie over the reversed prefixes, so one row's banned
tokens cost one dict lookup per history token the walk matches (at most the longest prefix),
never a pass over the words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

MAX_BAD_WORD_TOKENS = 128  # per word (their number and characters: SamplingParams)

Encode = Callable[[list[str]], list[list[int]]]  # texts -> token ids, no special tokens


def bad_words_token_ids(words: Sequence[str], encode: Encode) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization: each word as is and, where that gives a different first token of the
    same length, after a space (a word in the middle of text). Raises ValueError naming
    ``bad_words`` for a word over ``MAX_BAD_WORD_TOKENS`` tokens."""
    stripped = [w.lstrip() for w in words]
    # NOTE: one batch each: the tokenizer releases the GIL and works in parallel.
    plain_ids = encode(stripped)
    for i, plain in enumerate(plain_ids):
        if len(plain) > MAX_BAD_WORD_TOKENS:  # NOTE: the spaced form is kept only as long
            raise ValueError(
                f"bad_words: word {i} is {len(plain)} tokens long; at most "
                f"{MAX_BAD_WORD_TOKENS} tokens per word"
            )
    spaced_ids = encode([" " + w for w in stripped])
    out: list[tuple[int, ...]] = []
    for plain, spaced in zip(plain_ids, spaced_ids):
        if plain:
            out.append(tuple(plain))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class BadWords:
    """One request's bad words, indexed (immutable: samples of one request share it)."""

    words: tuple[str, ...]  # as given: what this was built from
    token_ids: tuple[tuple[int, ...], ...]
    always: torch.Tensor  # [A] long: the one-token words, banned on every row
    # the trie over reversed prefixes: (node << 32 | token) -> child (the root is 0), and
    # node -> the last tokens of the words whose prefix ends there
    edges: dict[int, int]
    banned: dict[int, tuple[int, ...]]
    max_prefix_len: int  # history a row needs: the longest word, less its last token

    @classmethod
    def build(cls, words: Sequence[str], encode: Encode) -> BadWords:
        token_ids = bad_words_token_ids(words, encode)
        edges: dict[int, int] = {}
        banned: dict[int, list[int]] = {}
        for word in token_ids:
            node = 0
            for token in reversed(word[:-1]):
                node = edges.setdefault(node << 32 | token, len(edges) + 1)
            banned.setdefault(node, []).append(word[-1])
        always = sorted(set(banned.pop(0, [])))
        return cls(
            tuple(words), token_ids, torch.tensor(always, dtype=torch.long), edges,
            {node: tuple(dict.fromkeys(last)) for node, last in banned.items()},
            max((len(w) - 1 for w in token_ids), default=0),
        )  # fmt: skip

    def banned_after(self, history: Sequence[int], end: int) -> list[int]:
        """The tokens banned after ``history[:end]`` (besides ``always``)."""
        out: list[int] = []
        node: int | None = 0
        edges, banned = self.edges, self.banned
        for i in range(end - 1, max(end - self.max_prefix_len, 0) - 1, -1):
            node = edges.get(node << 32 | history[i])  # type: ignore[operator]
            if node is None:
                break
            out.extend(banned.get(node, ()))
        return out

    def apply(
        self,
        logits: torch.Tensor,  # [k+1, V]
        output_tail: Sequence[int],  # the output's last tokens (at least max_prefix_len)
        draft_token_ids: Sequence[int],  # k: row r follows the output and drafts[:r]
    ) -> torch.Tensor:  # [k+1, V], a copy where anything is banned
        history = [*output_tail, *draft_token_ids]
        rows: list[int] = []
        cols: list[int] = []
        for r in range(logits.shape[0]):
            found = self.banned_after(history, len(output_tail) + r)
            rows.extend([r] * len(found))
            cols.extend(found)
        if not rows and not self.always.numel():
            return logits
        logits = logits.clone()
        if self.always.numel():
            logits.index_fill_(1, self.always.to(logits.device), float("-inf"))
        if rows:
            logits[rows, cols] = float("-inf")
        return logits
