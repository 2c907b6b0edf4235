"""What a request's output must match: vLLM's ``StructuredOutputsParams`` (and its older name,
``GuidedDecodingParams``), one constraint per request."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field, fields
from typing import Any

MAX_CHOICES = 4096
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar as text
MAX_JSON_DEPTH = 64  # a JSON schema's nesting (the server's request bodies have the same limit)

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema: dict, JSON text, or a pydantic model class),
    ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark, or GBNF as
    llama.cpp writes it) and ``json_object`` (any JSON object).

    ``disable_any_whitespace``: JSON without free whitespace between tokens (small models may
    otherwise fill max_tokens with newlines); ``disable_additional_properties``: objects of the
    schema take no keys beyond ``properties`` unless the schema says otherwise;
    ``whitespace_pattern``: the regex JSON whitespace must match. ``backend`` and
    ``disable_fallback`` are vLLM's and accepted: there is one backend (llguidance)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None
    disable_fallback: bool = False
    # the compiled grammar (a structured.Grammar), when the caller compiled it ahead (the server
    # does, off the engine's thread); each request takes its own copy
    compiled: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.json is not None and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class

    @property
    def kind(self) -> str:
        """The constraint's field name: json, regex, choice, grammar or json_object."""
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: give exactly one of json, regex, choice, grammar and "
                f"json_object (got {', '.join(given) if given else 'none'})"
            )
        return given[0]

    def validate(self) -> None:
        """Types and sizes; the constraint itself is checked when it is compiled."""
        kind = self.kind
        value = getattr(self, kind)
        where = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    self.json = value = _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"{where} must be a JSON schema (an object), not {value!r:.80}")
            if _depth(value) > MAX_JSON_DEPTH:
                raise ValueError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
            if len(_json.dumps(value)) > MAX_SPEC_CHARS:
                raise ValueError(f"{where} is longer than {MAX_SPEC_CHARS} characters")
        elif kind == "choice":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) for c in value)
            ):
                raise ValueError(f"{where} must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"{where} has more than {MAX_CHOICES} strings")
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"{where} must be true")
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{where} must be a non-empty string")
            if len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"{where} is longer than {MAX_SPEC_CHARS} characters")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string")

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsParams:
        """From itself, a dict of its fields (the server's and LLM's JSON), or vLLM's older
        ``GuidedDecodingParams``-like object."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = {f.name for f in fields(cls)} - {"compiled"}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {unknown[0]!r}")
            return cls(**value)
        names = [f.name for f in fields(cls)]
        if any(hasattr(value, n) for n in _KINDS):
            return cls(**{n: getattr(value, n) for n in names if hasattr(value, n)})
        raise ValueError(
            "structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
            f"not {type(value).__name__}"
        )


def _depth(value: Any) -> int:
    """How deeply JSON containers nest in ``value`` (iteratively: no recursion to overflow)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children)
    return deepest


# vLLM's name before 0.10.2
GuidedDecodingParams = StructuredOutputsParams
