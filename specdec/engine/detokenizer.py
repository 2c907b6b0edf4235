"""Streaming detokenization: text deltas for newly generated tokens.

Decoding token by token is wrong in two ways: a character can be split over several byte tokens
(an emoji over four byte-level tokens), and some decoders treat the first token of a decode call
differently (SentencePiece strips its leading space). Decoding the whole sequence at every step is
right but quadratic. We decode a short window instead:

    ids:     ... | prefix_offset ...... read_offset ...... len(ids)
                   '-- already emitted --'-- new tokens --'

`decode(ids[prefix_offset:])` starts with `decode(ids[prefix_offset:read_offset])`, text we have
already emitted; what follows it is the delta. `read_offset` only moves to a token boundary where
the decoded text is complete (it does not end in U+FFFD), and `prefix_offset` then moves up to a
recent character boundary, so each call decodes a few tokens whatever the sequence length.

While the tail is an incomplete UTF-8 sequence (decoded as U+FFFD), the complete text before it is
still emitted, and the tail is held back until it completes. With SentencePiece byte fallback, a
run of `<0x..>` tokens is held back until a normal token ends it: the decoder turns the whole run
into U+FFFDs if any of its bytes is invalid, so the run's text is not known before. `finalize()` flushes whatever is held
back, so that at the end the deltas joined are exactly `tokenizer.decode(output_ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.model.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT_CHAR = "\ufffd"
# How far back from a new read offset we look for a character boundary to start the next window.
# One token is usually enough; a few more cover multi-token characters.
_MAX_PREFIX_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    The output is decoded on its own (the prompt is kept only as `prompt_token_ids`), so that
    `output_text == tokenizer.decode(output_token_ids, skip_special_tokens)` once finalized.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # first token of the decode window
        self._read_offset = 0  # tokens before this are fully emitted
        self._prefix_len = 0  # len(decode(ids[prefix_offset:read_offset]))
        self._held_emitted = 0  # chars emitted beyond the prefix while the tail is incomplete
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._finalized = False

    # ---- public ----------------------------------------------------------------------------

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids and return the text they complete (may be "")."""
        if not new_ids:
            return ""
        self._ids.extend(int(i) for i in new_ids)
        self._finalized = False
        return self._step(final=False)

    def finalize(self) -> str:
        """Flush text held back for an incomplete character (it decodes as U+FFFD)."""
        if self._finalized:
            return ""
        self._finalized = True
        return self._step(final=True)

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache] if self._text_cache else []
        return self._text_cache

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids added so far (a copy)."""
        return list(self._ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose text is not fully emitted yet (an incomplete character at the tail)."""
        return len(self._ids) - self._read_offset

    # ---- internals -------------------------------------------------------------------------

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
        return delta

    def _step(self, final: bool) -> str:
        text = self._decode(self._prefix_offset)
        start = self._prefix_len + self._held_emitted
        if not final:
            stable = self._stable_length(text)
            if stable is not None:
                # The tail may still change: emit the settled text before it, hold the rest.
                if stable <= start:
                    return ""
                self._held_emitted += stable - start
                return self._emit(text[start:stable])
        delta = text[start:]
        self._advance(len(self._ids))
        return self._emit(delta)

    def _stable_length(self, text: str) -> int | None:
        """Length of the settled part of the window text, or None if all of it is settled."""
        byte_ids = self.tokenizer.byte_fallback_token_ids
        if byte_ids:
            # A byte-fallback decoder turns a whole run of <0x..> tokens into U+FFFDs if any byte
            # of it is invalid, so a run's text is only known once a normal token ends it.
            # Special tokens dropped by the decode do not end a run: look through them.
            skipped = self.tokenizer.special_token_ids if self.skip_special_tokens else ()
            run_start = len(self._ids)
            while run_start > self._prefix_offset and self._ids[run_start - 1] in skipped:
                run_start -= 1
            if run_start > self._prefix_offset and self._ids[run_start - 1] in byte_ids:
                while run_start > self._prefix_offset and (
                    self._ids[run_start - 1] in byte_ids or self._ids[run_start - 1] in skipped
                ):
                    run_start -= 1
                stable_text = self._decode(self._prefix_offset, run_start)
                return len(stable_text.rstrip(REPLACEMENT_CHAR))
        if text.endswith(REPLACEMENT_CHAR):
            # An incomplete UTF-8 sequence decodes as U+FFFD until its last byte arrives.
            return len(text.rstrip(REPLACEMENT_CHAR))
        return None

    def _advance(self, read_offset: int) -> None:
        """Everything before `read_offset` is emitted; start the next window shortly before it.

        The new window start must be a token where decoding can begin without changing the text
        that follows: its text must not start with U+FFFD (a token starting with a UTF-8
        continuation byte) and must not be empty (a decoder that strips the first leading space,
        like SentencePiece's, needs visible text before the new tokens). The current window start
        always qualifies, so we fall back to it.
        """
        lowest = max(self._prefix_offset, read_offset - _MAX_PREFIX_TOKENS)
        prefix = self._prefix_offset
        prefix_text: str | None = None
        for candidate in range(read_offset - 1, lowest - 1, -1):
            text = self._decode(candidate, read_offset)
            if text and not text.startswith(REPLACEMENT_CHAR):
                prefix, prefix_text = candidate, text
                break
        if prefix_text is None:
            prefix_text = self._decode(prefix, read_offset)
        self._prefix_offset = prefix
        self._read_offset = read_offset
        self._prefix_len = len(prefix_text)
        self._held_emitted = 0
