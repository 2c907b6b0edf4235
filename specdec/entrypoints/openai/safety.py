"""What the server checks before it trusts anything a client sent: a bounded JSON body, the Host
header, and client text on its way into the logs.

Every check here is cheap and bounded by the body size limit, so a hostile body costs a 400 and a
few milliseconds, never an unbounded parse, a 500 or a frozen event loop.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdec.entrypoints.openai.protocol import RequestError


@dataclass(frozen=True)
class JSONLimits:
    """Bounds on a request body's JSON, checked before the handlers see it."""

    max_depth: int = 64
    # NOTE: '[' and '{' bytes are counted in the raw body, strings included, before parsing: a
    # body of 1.8M nested empty lists parses for ~0.9 s with the GIL held (the event loop with it).
    # A real prompt needs ~100k '[' and '{' to reach this: far beyond any context served here.
    max_containers: int = 65536
    max_numbers: int = 131072  # token-id prompts: up to a 128k context
    max_list_items: int = 131072
    max_object_keys: int = 1024
    max_string_chars: int = 1 << 20


DEFAULT_JSON_LIMITS = JSONLimits()
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Refused(Exception):
    """Raised from inside json.loads' hooks to stop parsing at once."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


def _json_error(message: str, code: str = "invalid_json", param: str | None = None) -> RequestError:
    return RequestError(message, param=param, code=code)


def parse_json_body(body: bytes, limits: JSONLimits = DEFAULT_JSON_LIMITS) -> dict[str, Any]:
    """The body as a JSON object within ``limits`` (RequestError 400 otherwise).

    Refuses malformed JSON, NaN / Infinity / out-of-range floats, nesting deeper than
    ``max_depth``, too many values, long strings and lists, and lone surrogates (which cannot be
    encoded as UTF-8 and would fail later, in the tokenizer or the response encoder).
    """
    containers = body.count(b"[") + body.count(b"{")
    if containers > limits.max_containers:
        raise _json_error(
            f"request body has {containers} '[' and '{{' characters; the limit is "
            f"{limits.max_containers}",
            code="request_too_complex",
        )
    numbers = 0

    def count_number(text: str, kind: type) -> Any:
        nonlocal numbers
        numbers += 1
        if numbers > limits.max_numbers:
            raise _Refused(
                _json_error(
                    f"request body has more than {limits.max_numbers} numbers",
                    code="request_too_complex",
                )
            )
        value = kind(text)
        if kind is float and not math.isfinite(value):
            raise _Refused(_json_error(f"number out of range: {text[:40]}"))
        return value

    def refuse_constant(name: str) -> Any:
        raise _Refused(_json_error(f"{name} is not valid JSON (numbers must be finite)"))

    try:
        data = json.loads(
            body,
            parse_int=lambda s: count_number(s, int),
            parse_float=lambda s: count_number(s, float),
            parse_constant=refuse_constant,
        )
    except _Refused as e:
        raise e.error from None
    except RecursionError:
        raise _json_error(
            f"request body is nested deeper than {limits.max_depth} levels", "request_too_complex"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _json_error(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _json_error("request body must be a JSON object")
    check_json_value(data, limits)
    return data


def check_json_value(value: Any, limits: JSONLimits = DEFAULT_JSON_LIMITS) -> None:
    """Check a parsed JSON value against ``limits``; the error names the path (``messages[0].content``)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_string(item, path, limits)
        elif isinstance(item, dict):
            if depth >= limits.max_depth:
                raise _too_deep(path, limits)
            if len(item) > limits.max_object_keys:
                raise _limit(path, f"has {len(item)} keys; the limit is {limits.max_object_keys}")
            for key, child in item.items():
                _check_string(key, path, limits)
                name = key if len(key) <= 64 else key[:64] + "..."
                stack.append((child, f"{path}.{name}" if path else name, depth + 1))
        elif isinstance(item, list):
            if depth >= limits.max_depth:
                raise _too_deep(path, limits)
            if len(item) > limits.max_list_items:
                raise _limit(path, f"has {len(item)} items; the limit is {limits.max_list_items}")
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_string(s: str, path: str, limits: JSONLimits) -> None:
    if len(s) > limits.max_string_chars:
        raise _limit(
            path, f"is a string of {len(s)} characters; the limit is {limits.max_string_chars}"
        )
    if has_surrogates(s):
        raise RequestError(
            f"{path or 'request body'}: a lone UTF-16 surrogate is not valid Unicode text",
            param=path or None,
            code="invalid_value",
        )


def has_surrogates(s: str) -> bool:
    """Whether ``s`` holds a lone UTF-16 surrogate (which no UTF-8 encoder accepts)."""
    return not s.isascii() and _SURROGATE.search(s) is not None


def _limit(path: str, what: str) -> RequestError:
    # NOTE: a deep path is mostly the client's own keys: its start and end name the place
    if len(path) > 120:
        path = f"{path[:80]}...{path[-30:]}"
    return RequestError(
        f"{path or 'request body'} {what}", param=path or None, code="request_too_complex"
    )


def _too_deep(path: str, limits: JSONLimits) -> RequestError:
    return _limit(path, f"is nested deeper than {limits.max_depth} levels")


# ---- Host header -------------------------------------------------------------------------------

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The Host names to accept by default: loopback names when bound to a loopback address
    (a DNS-rebinding page then cannot reach the server), None (any) otherwise."""
    name = bind_host.strip("[]").lower()
    if name == "localhost":
        return list(LOOPBACK_NAMES)
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        return None
    return list(dict.fromkeys([*LOOPBACK_NAMES, name])) if loopback else None


def host_name(header: str) -> str:
    """The name part of a Host header: ``example.com:8000`` -> ``example.com``, ``[::1]:80`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else ""
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str | None, allowed: Sequence[str] | None) -> bool:
    """Whether a Host header names this server: ``allowed`` None or containing ``*`` accepts any;
    ``*.example.com`` accepts its subdomains."""
    if allowed is None or "*" in allowed:
        return True
    name = host_name(header or "").rstrip(".")
    if not name:
        return False
    for pattern in allowed:
        pattern = pattern.lower()
        if name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


# ---- logs ----------------------------------------------------------------------------------------


def for_log(text: object, limit: int = 200) -> str:
    """Client text made safe for one log line: escaped (no newlines or control characters) and
    cut to ``limit`` characters."""
    s = str(text)
    cut = len(s) > limit
    escaped = ascii(s[:limit])
    return escaped + "..." if cut else escaped


# ---- text the tokenizer cannot represent ------------------------------------------------------


def dropped_bytes(tokenizer: Any) -> bytes:
    """The bytes a byte-level BPE ``tokenizer`` (a ``tokenizers.Tokenizer``) drops without a
    trace: those whose byte character has no token, in a vocabulary without an unknown token.

    SmolLM2's has none for 0x04, 0x06, 0x13, 0x14, 0x16 and 0x1d, nor for 0xf1-0xf4 (lead bytes
    of U+40000 and above); "hi\\x14there" is "hithere" to it, as to transformers' tokenizer for
    the same file. Empty for other tokenizers (byte fallback, an unknown token, no byte level).
    ``tokenizer`` may be a `Tokenizer`: a compact one (SentencePiece with byte fallback) drops
    nothing."""
    from specdec.model.tokenizer import Tokenizer, bytes_to_unicode

    if isinstance(tokenizer, Tokenizer):
        if tokenizer.compact:
            return b""
        tokenizer = tokenizer.hf
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    model = spec.get("model") or {}
    byte_level = any(p.get("type") == "ByteLevel" for p in parts)
    if not byte_level or model.get("type") != "BPE" or model.get("unk_token") is not None:
        return b""
    vocab = model.get("vocab") or {}
    return bytes(b for b, ch in sorted(bytes_to_unicode().items()) if ch not in vocab)


def unrepresentable(text: str, dropped: bytes) -> str | None:
    """The first character of ``text`` with a byte in ``dropped``, or None (one pass over the
    UTF-8 bytes, ~1 ms per MB)."""
    if not dropped:
        return None
    data = text.encode("utf-8", "surrogatepass")
    if len(data.translate(None, dropped)) == len(data):
        return None
    found = re.search(b"[" + b"".join(re.escape(bytes([b])) for b in dropped) + b"]", data)
    assert found is not None
    start = found.start()
    while start > 0 and 0x80 <= data[start] < 0xC0:  # back to the character's first byte
        start -= 1
    return data[start : start + 4].decode("utf-8", "ignore")[0]


def unrepresentable_error(param: str, char: str) -> RequestError:
    return RequestError(
        f"{param}: character U+{ord(char):04X} has no token in this model's vocabulary (it "
        "would be dropped silently)",
        param=param,
        code="invalid_value",
    )
