"""Special-token strings typed by clients (``--special-tokens-in-content``).

A chat template writes its turn markers as text (``<|im_start|>user\\n...``), and the tokenizer
turns every special token's string it finds in the rendered prompt into that token: by default
(``allow``, as vLLM and transformers do) a ``<|im_start|>`` typed in a message becomes a real turn
marker. ``text`` reads such strings in client text as plain characters (the template's own markers
stay special); ``reject`` refuses the request with a 400 naming the field.

``text`` for a chat: each special-token string in client values (messages, tools, template
variables) is replaced by a placeholder before rendering; the rendered prompt is split at the
special tokens left (the template's), and the text between them, placeholders restored, is
tokenized with special-token strings read as text. A request whose client text holds none takes
the ordinary path, so its ids are those of ``allow``.

"Special tokens" here are the tokenizer's control tokens (``Tokenizer.control_token_ids``): those
flagged special, and the added tokens written as markers that vocabularies leave unflagged
(Qwen's ``<tool_call>`` and ``<think>``), which the tokenizer matches in any text all the same.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

from specdec.entrypoints.openai.protocol import RequestError
from specdec.model.tokenizer import Tokenizer

SpecialTokenMode = Literal["allow", "text", "reject"]
SPECIAL_TOKEN_MODES: tuple[SpecialTokenMode, ...] = ("allow", "text", "reject")
_STRICTNESS = {"allow": 0, "text": 1, "reject": 2}
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def effective_mode(server: SpecialTokenMode, requested: SpecialTokenMode | None) -> str:
    """The mode a request runs under: the server's, or a stricter one the request asks for (a
    request cannot loosen the operator's choice: that is a 400)."""
    if requested is None or requested == server:
        return server
    if _STRICTNESS[requested] < _STRICTNESS[server]:
        raise RequestError(
            f"special_tokens_in_content '{requested}' is looser than this server's setting "
            f"'{server}' (--special-tokens-in-content)",
            param="special_tokens_in_content",
        )
    return requested


def special_token_error(param: str, token_id: int) -> RequestError:
    """The 400 of ``reject``: names the field and the token id, never the client's text."""
    return RequestError(
        f"{param} holds the text of special (control) token {token_id} of this model's vocabulary; this "
        "server refuses special-token strings in client text (--special-tokens-in-content reject)",
        param=param,
        code="special_token_in_content",
    )


def _key_path(path: str, key: object) -> str:
    name = key if isinstance(key, str) and _KEY.fullmatch(key) else "?"
    return f"{path}.{name}" if path else name


def find_special(tokenizer: Tokenizer, value: Any, path: str) -> tuple[str, int] | None:
    """The first string in ``value`` (a JSON-like value: strings, dict keys and values, lists)
    holding a special token's string: (its path, e.g. ``messages[2].content``, the token id)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            found = tokenizer.find_special_token(item)
            if found is not None:
                return where or "request", found[0]
        elif isinstance(item, dict):
            children = []
            for k, v in item.items():
                found = tokenizer.find_special_token(k) if isinstance(k, str) else None
                if found is not None:
                    return _key_path(where, k), found[0]
                children.append((v, _key_path(where, k)))
            stack.extend(reversed(children))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed([(v, f"{where}[{i}]") for i, v in enumerate(item)]))
    return None


class LiteralSpecials:
    """Placeholders for the special-token strings found in client values (``text``): ``mask``
    hides them from the tokenizer's special-token matching, ``encode`` tokenizes a prompt rendered
    from masked values."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._nonce = "".join(secrets.choice("0123456789") for _ in range(16))
        self._strings: list[str] = []
        self._index: dict[str, int] = {}
        # NOTE: digits and private-use characters only: a template's filters (upper, trim,
        # split) leave them whole
        self._restore_re = re.compile("\ue000" + self._nonce + r"(\d{6})\ue001")

    @property
    def found(self) -> bool:
        return bool(self._strings)

    def _placeholder(self, special: str) -> str:
        index = self._index.get(special)
        if index is None:
            index = self._index[special] = len(self._strings)
            self._strings.append(special)
        return f"\ue000{self._nonce}{index:06d}\ue001"

    def mask(self, value: Any) -> Any:
        """``value`` with every special-token string in its strings (and dict keys) replaced by a
        placeholder; values without any are returned as they are."""
        if isinstance(value, str):
            pattern = self.tokenizer.special_token_pattern
            if pattern is None or self.tokenizer.find_special_token(value) is None:
                return value
            return pattern.sub(lambda m: self._placeholder(m.group()), value)
        if isinstance(value, dict):
            return {self.mask(k): self.mask(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mask(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.mask(v) for v in value)
        return value

    def restore(self, text: str) -> str:
        """``text`` with the placeholders back as the strings they stand for."""
        return self._restore_re.sub(lambda m: self._strings[int(m.group(1))], text)

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a prompt rendered from masked values: the special tokens it holds (the
        template's) as tokens, the text between them (placeholders restored) read as text."""
        pieces = self.tokenizer.split_special_tokens(rendered)
        texts = [self.restore(p) for p in pieces if isinstance(p, str)]
        encoded = iter(self.tokenizer.encode_plain_batch(texts, add_special_tokens=False))
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(next(encoded))
        return ids
