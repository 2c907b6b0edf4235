"""Tool calling in OpenAI's shape (``tools``, ``tool_choice``), with the call's arguments
constrained by the grammar to the tool's JSON schema.

- ``tool_choice`` a named function: the output is that function's arguments (a JSON object of
  its ``parameters`` schema); the reply carries one call, finish_reason ``stop`` (OpenAI's).
- ``required``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``, at least
  one, each matching its tool (vLLM's format, which needs nothing from the model's template).
- ``auto``: the model writes text and, where it decides to call, ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks (Hermes / Qwen 2.5 / SmolLM3 templates); after the
  opening tag the grammar holds the call to a tool's schema; text is free. Models whose template
  does not write that tag get a 400 for ``auto`` (``required`` and named calls still work).
- ``none`` (the default without tools): plain chat, tools not shown to the model.

The model's chat template must take ``tools`` (it lists them for the model); a template that
never reads ``tools`` gets a 400 naming ``tools``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from specdec.entrypoints.openai.protocol import RequestError
from specdec.structured.compile_worker import map_objects
from specdec.structured.params import StructuredOutputsParams

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
WS = r"[ ]?"  # JSON whitespace inside a call


def template_reads_tools(template: str | None) -> bool:
    """Whether the chat template uses the ``tools`` variable."""
    if not template:
        return False
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "tools" in template
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolPlan:
    """What a chat request with tools needs: the tools for the template, the output
    constraint, and how to read calls back out of the text."""

    tools: list[dict[str, Any]]
    mode: str  # "auto", "required" or "named"
    name: str | None = None  # the named function

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        return {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
            for t in self.tools
        }

    def constraint(self) -> StructuredOutputsParams:
        schemas = self.schemas
        # NOTE: at most one space between JSON tokens: compact or json.dumps-style calls both
        # fit, and a small model cannot fill max_tokens with whitespace inside a call
        if self.mode == "named":
            return StructuredOutputsParams(json=schemas[self.name], whitespace_pattern=WS)
        if self.mode == "required":
            calls, defs = [], {}
            for i, (name, schema) in enumerate(schemas.items()):
                schema, own = _hoisted_defs(schema, f"tool{i}_")
                defs.update(own)
                calls.append(
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": schema},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                )
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if defs:
                array["$defs"] = defs
            return StructuredOutputsParams(json=array, whitespace_pattern=WS)
        return StructuredOutputsParams(grammar=self._auto_grammar())

    def _auto_grammar(self) -> str:
        """Free text with Hermes tool calls: after ``<tool_call>`` the call must name a tool
        and give arguments of its schema (a lazy trigger, so text is unconstrained until it)."""
        alternatives = []
        for i, (name, schema) in enumerate(self.schemas.items()):
            begin = json.dumps(f'\n{{"name": {json.dumps(name)}, "arguments": ')
            alternatives.append(f'call_{i}: {begin} %json {json.dumps(schema)} "}}\\n"')
        names = " | ".join(f"call_{i}" for i in range(len(alternatives)))
        return "\n".join(
            [
                "%llguidance {}",
                "start: (trigger (" + names + ') "</tool_call>")* TEXT',
                f"trigger[lazy]: TEXT {json.dumps(HERMES_OPEN)}",
                r"TEXT: /(.|\n)*/",
                *alternatives,
            ]
        )

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the message content, the calls) of the generated text."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            # NOTE: cut by max_tokens, the calls already complete are kept; with none, the text
            items, _ = _json_array_items(text)
            calls = [
                ToolCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                for it in items
            ]
            return (None if calls else text), calls
        calls, content, pos = [], [], 0
        while (start := text.find(HERMES_OPEN, pos)) != -1:
            end = text.find(HERMES_CLOSE, start)
            if end == -1:
                break
            content.append(text[pos:start])
            try:
                call = json.loads(text[start + len(HERMES_OPEN) : end])
                calls.append(
                    ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False))
                )
            except (ValueError, KeyError, TypeError):
                content.append(text[start : end + len(HERMES_CLOSE)])
            pos = end + len(HERMES_CLOSE)
        content.append(text[pos:])
        rest = "".join(content).strip()
        return (rest or None) if calls else text, calls


def _hoisted_defs(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """A tool's schema to nest inside another: its ``$defs`` / ``definitions`` (what pydantic
    writes) renamed with ``prefix`` for the outer root, and its local ``$ref``s rewritten to
    them (``#`` itself becomes a definition of its own)."""
    if not isinstance(schema, dict):
        return schema, {}
    names = {
        f"#/{group}/{name}": f"#/$defs/{prefix}{name}"
        for group in ("$defs", "definitions")
        for name in (schema.get(group) or {})
    }
    names["#"] = f"#/$defs/{prefix}root"

    def renamed(out: dict) -> dict:
        ref = out.get("$ref")
        if isinstance(ref, str) and ref in names:
            out["$ref"] = names[ref]
        return out

    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    defs = {
        f"{prefix}{name}": map_objects(d, renamed)
        for group in ("$defs", "definitions")
        for name, d in (schema.get(group) or {}).items()
    }
    body = map_objects(body, renamed)
    defs[f"{prefix}root"] = body
    return body, defs


def _json_array_items(text: str) -> tuple[list[Any], bool]:
    """The complete items at the start of a JSON array, and whether the array is complete."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos == -1:
        return [], False
    items: list[Any] = []
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if text.startswith("]", pos):
            return items, True
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return items, False
        items.append(item)
        pos = _skip_ws(text, pos)
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("]", pos):
            return items, False


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def plan_tools(tools: list[Any] | None, tool_choice: Any, template: str | None) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice`` (400s name the field); None when no tool may be
    called (no tools, or tool_choice "none")."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(
                f"tool_choice must be none, auto, required or a function, got {tool_choice!r:.40}",
                "tool_choice",
            )
    elif not (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        raise RequestError(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not tools:
        if tool_choice != "none":
            raise RequestError("tool_choice needs tools", "tool_choice")
        return None
    checked = _check_tools(tools)
    if tool_choice == "none":
        return None
    if not template_reads_tools(template):
        raise RequestError(
            "this model's chat template never reads `tools`: serve it with "
            "--chat-template chatml-tools (ChatML models such as SmolLM2, Qwen 2) or another "
            "template that lists them, or send tool_choice none",
            "tools",
            code="unsupported_parameter",
        )
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in {t["function"]["name"] for t in checked}:
            raise RequestError(
                f"tool_choice names {name!r:.80}, which is not among the tools",
                "tool_choice.function.name",
            )
        return ToolPlan(checked, "named", name)
    if tool_choice == "auto" and HERMES_OPEN not in (template or ""):
        raise RequestError(
            "tool_choice auto: this model's template does not write <tool_call> blocks, so its "
            "calls cannot be read from its text; use tool_choice required or a named function",
            "tool_choice",
            code="unsupported_parameter",
        )
    return ToolPlan(checked, tool_choice)


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f'{where}.type must be "function"', f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(
                f"{where}.function.name must be 1-64 letters, digits, _ . or -",
                f"{where}.function.name",
            )
        if name in seen:
            raise RequestError(
                f"{where}.function.name {name!r} is repeated", f"{where}.function.name"
            )
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(
                f"{where}.function.parameters must be a JSON schema (an object)",
                f"{where}.function.parameters",
            )
        out.append({"type": "function", "function": fn})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects, as templates read them
    (``tool_call.arguments | tojson``); OpenAI sends them as JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m = dict(m)
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except ValueError:
                        pass
                    c = {**c, "function": fn}
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out
