"""The command line's parser, as vLLM's ``FlexibleArgumentParser`` behaves for its users.

- ``--help`` fits on a screen: the common flags by section (model, cache, scheduler, speculative,
  parallel, server, ...), each section's other flags counted, and the flags accepted without
  effect in one line. ``--help=all`` prints every flag, ``--help=<section>`` one section (a
  section's name or the vLLM config class it maps to: ``--help=ModelConfig``), and
  ``--help=<flag>`` the flags whose names contain it (``--help=max-model-len``; ``_`` and ``-``
  alike). ``--help-all`` is ``--help=all``. Every option shows its default. As vLLM's,
  ``--help=listgroup`` lists the sections and ``--help=page`` shows every flag in a pager.
- vLLM's dotted JSON flags: ``--speculative-config.method ngram`` is
  ``--speculative-config '{"method": "ngram"}'`` for any flag whose value is a JSON object; the
  keys of several dotted flags (and of the flag given whole) are merged.
"""

from __future__ import annotations

import argparse
import copy
import json
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

from specdec.config import HELP_SECTIONS as SECTIONS
from specdec.config import common, section_group

__all__ = ["ArgumentParser", "HelpFormatter", "common", "expand_dotted", "section_group"]

HELP_TIPS = (
    ("--help=all", "every flag"),
    ("--help=SECTION", "one section: {sections} (or vLLM's config class: --help=ModelConfig)"),
    ("--help=FLAG", "the flags whose names contain FLAG (--help=max-model-len; _ or -)"),
    ("--help=listgroup", "the sections; --help=page: every flag in a pager"),
)
# flags whose value is a JSON object (their type is not json_value)
JSON_OBJECT_DESTS = ("speculative_config",)


def _shown_default(action: argparse.Action) -> str | None:
    """The default as --help shows it, or None where it says nothing useful."""
    default = action.default
    if not action.option_strings and default is None:  # an optional positional
        return None
    if default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return None
    if action.nargs == 0 and isinstance(default, bool | None):  # switches
        unset = "unset" if isinstance(action, argparse.BooleanOptionalAction) else "off"
        return {True: "on", False: "off", None: unset}[default]
    if default is None:
        return "none"
    if isinstance(default, list | tuple):
        return " ".join(map(str, default)) or "none"
    return str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One metavar for all of a flag's spellings (``compact``: ``--[no-]X`` too) and each
    option's default after its help (unless the help already speaks of its default)."""

    def __init__(self, prog: str, **kw: Any) -> None:
        kw.setdefault("max_help_position", 30)
        super().__init__(prog, **kw)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        name = getattr(action.type, "__name__", "")
        if name in ("int", "human_int"):
            return "N"
        if name == "float":
            return "NUM"
        if name == "json_value" or action.dest in JSON_OBJECT_DESTS:
            return "JSON"
        return "TEXT" if len(action.dest) > 12 else action.dest.upper()

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        names = list(action.option_strings)
        if getattr(self, "compact", False) and isinstance(action, argparse.BooleanOptionalAction):
            names = [f"--[no-]{n[2:]}" for n in names if n.startswith("--") and not n.startswith("--no-")]  # fmt: skip
            names += [n for n in action.option_strings if not n.startswith("--")]
        text = ", ".join(names)
        if action.nargs != 0:
            text += " " + self._format_args(action, self._get_default_metavar_for_optional(action))
        return text

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)"
        if "default" in text.lower():
            return text
        shown = _shown_default(action)
        if shown is None:
            return text
        return f"{text} (default: {shown.replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """One line per error; sectioned ``--help`` (``sectioned`` parsers: ``generate``,
    ``serve``), ``--help=<query>`` (``help_query``) on every parser."""

    sectioned = False
    help_query: str | None = None

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw["formatter_class"] = HelpFormatter
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        query = self.help_query
        if self._subparsers is not None or (query is None and not self.sectioned):
            return super().format_help()
        if query is None:
            return self._short_help()
        key = query.lower().replace("_", "-").lstrip("-")
        if key in ("all", "page"):
            return self._sections_help(list(self._sections()), show_all=True)
        if key == "listgroup":
            return self._list_sections()
        for name, actions in self._sections():
            if key in (name, *(c.lower() for c in SECTIONS.get(name, ("", ()))[1])):
                return self._sections_help([(name, actions)], show_all=True)
        return self._search_help(key)

    def print_help(self, file: Any = None) -> None:
        if self.help_query is not None and self.help_query.lower() == "page" and file is None:
            import pydoc

            pydoc.pager(self.format_help())  # NOTE: $PAGER, else less; plain output off a TTY
            return
        super().print_help(file)

    def _list_sections(self) -> str:
        """``--help=listgroup``: each section with its flag count and vLLM config classes."""
        lines = [f"{self.prog}: sections (--help=SECTION shows one):"]
        for name, actions in self._sections():
            classes = ", ".join(SECTIONS.get(name, ("", ()))[1])
            also = f" (also --help={classes.split(', ')[0]})" if classes else ""
            lines.append(f"  {name}: {len(actions)} flags{also}")
        return "\n".join(lines) + "\n"

    # ---- the pieces ------------------------------------------------------------------------
    def _sections(self) -> Iterator[tuple[str, list[argparse.Action]]]:
        """(section, its actions) in SECTIONS' order; actions outside sections under 'options'."""
        by_name: dict[str, list[argparse.Action]] = {}
        self._descriptions: dict[str, str] = {}
        for group in self._action_groups:
            name = getattr(group, "section", None) or "options"
            self._descriptions.setdefault(name, group.description or "")
            by_name.setdefault(name, []).extend(
                a for a in group._group_actions if not isinstance(a, argparse._HelpAction)
            )
        for name in (*SECTIONS, "options"):
            if by_name.get(name):
                yield name, by_name[name]

    def _heading(self, name: str) -> str:
        what = self._descriptions.get(name) or SECTIONS.get(name, ("", ()))[0]
        classes = SECTIONS.get(name, ("", ()))[1]
        also = f" (vLLM's {', '.join(classes)})" if classes and name != "ignored" else ""
        return f"{name}: {what}{also}" if what else name

    def _sections_help(
        self, sections: list[tuple[str, list[argparse.Action]]], show_all: bool
    ) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        for name, actions in sections:
            formatter.start_section(self._heading(name))
            formatter.add_arguments(actions)
            formatter.end_section()
        formatter.add_text(self._tips())
        return formatter.format_help()

    def _short_help(self) -> str:
        """The common flags by section; each section's others counted; the ignored in a line."""
        formatter = self._get_formatter()
        formatter.compact = True  # type: ignore[attr-defined]
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        ignored = 0
        for name, actions in self._sections():
            if name == "ignored":
                ignored = len(actions)
                continue
            shown = [_short(a) for a in actions if getattr(a, "common", False)]
            more = len(actions) - len(shown)
            heading = name if not more else f"{name} ({more} more: --help={name})"
            formatter.start_section(heading)
            formatter.add_arguments(shown)
            formatter.end_section()
        if ignored:
            text = (
                f"accepted without effect: {ignored} vLLM / llama.cpp flags (GPU, multimodal, "
                "LoRA, ...; logged once), or at their defaults only: --help=ignored"
            )
            formatter.add_text(textwrap.fill(text, width=getattr(self, "_width", 78)))
        formatter.add_text(self._tips())
        return formatter.format_help()

    def _get_formatter(self) -> argparse.HelpFormatter:
        formatter = super()._get_formatter()
        self._width = getattr(formatter, "_width", 78)
        return formatter

    def _search_help(self, key: str) -> str:
        matched = [
            a
            for a in self._actions
            if any(key in o.lower().lstrip("-") for o in a.option_strings)
            and not isinstance(a, argparse._HelpAction)
        ]
        formatter = self._get_formatter()
        if not matched:
            formatter.add_text(
                f"No section or flag matches {key!r}: {self.prog} --help lists the sections, "
                "--help=all every flag."
            )
            return formatter.format_help()
        formatter.start_section(f"flags matching {key!r}")
        formatter.add_arguments(matched)
        formatter.end_section()
        return formatter.format_help()

    def _tips(self) -> str:
        """The --help=... forms, wrapped to the terminal (raw text is not wrapped)."""
        names = ", ".join(n for n, _ in self._sections() if n != "options")
        lines = []
        for form, what in HELP_TIPS:
            lines += textwrap.wrap(
                what.format(sections=names), width=getattr(self, "_width", 78),
                initial_indent=f"{form:<17}", subsequent_indent=" " * 17,
            )  # fmt: skip
        return "\n".join(lines)


def _short(action: argparse.Action) -> argparse.Action:
    """``action`` with its short help, if it has one (a copy: --help=all keeps the long)."""
    short = getattr(action, "short_help", None)
    if not short:
        return action
    shown = copy.copy(action)
    shown.help = short
    return shown


# ---- the command line before parsing -----------------------------------------------------------
def help_query(argv: list[str]) -> tuple[list[str], str | None]:
    """``--help=X`` / ``--help-all`` taken out of ``argv`` (as ``--help``) and the query X."""
    query = None
    out = []
    for a in argv:
        if a == "--help-all":
            a, query = "--help", "all"
        elif a.startswith("--help="):
            a, query = "--help", a.split("=", 1)[1]
        out.append(a)
    return out, query


def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every sub-command's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from walk(child)


def json_flags(parsers: Iterable[argparse.ArgumentParser]) -> dict[str, str]:
    """Every spelling of the flags whose value is a JSON object -> their long name."""
    flags: dict[str, str] = {}
    for parser in parsers:
        for a in parser._actions:
            is_json = getattr(a.type, "__name__", "") == "json_value"
            if a.option_strings and (is_json or a.dest in JSON_OBJECT_DESTS):
                long = next(o for o in a.option_strings if o.startswith("--"))
                flags.update(dict.fromkeys(a.option_strings, long))
    return flags


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def expand_dotted(argv: list[str], flags: dict[str, str]) -> list[str]:
    """vLLM's dotted JSON flags (``--X.a.b V`` / ``--X.a.b=V``: ``{"a": {"b": V}}`` for flag
    ``--X``, V read as JSON where it parses, else as text) merged into one ``--X JSON``, at the
    first dotted one's place; a ``--X '{...}'`` given whole is merged under them."""
    dotted: dict[str, dict[str, Any]] = {}
    out: list[str | tuple[str]] = []  # (long name,): where that flag's JSON goes
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        base, _, path = name.partition(".")
        if not (arg.startswith("--") and path and base in flags and all(path.split("."))):
            out.append(arg)
            i += 1
            continue
        if not eq and i + 1 >= len(argv):
            return argv  # NOTE: no value: argparse names the flag
        value = inline if eq else argv[i + 1]
        i += 1 if eq else 2
        long = flags[base]
        if long not in dotted:
            dotted[long] = {}
            out += [long, (long,)]
        _put(dotted[long], path.split("."), _parse_value(value))
    if not dotted:
        return argv
    whole: dict[str, dict[str, Any]] = {}
    result: list[str | tuple[str]] = []
    i = 0
    while i < len(out):
        arg = out[i]
        name, eq, inline = arg.partition("=") if isinstance(arg, str) else ("", "", "")
        long = flags.get(name)
        nxt = out[i + 1] if i + 1 < len(out) else None
        if long in dotted and (eq or isinstance(nxt, str)):
            parsed = _parse_value(inline if eq else nxt)
            if isinstance(parsed, dict):  # NOTE: else left for the flag's own error
                whole[long] = _deep_merge(whole.get(long, {}), parsed)
                i += 1 if eq else 2
                continue
        result.append(arg)
        i += 1
    return [
        a if isinstance(a, str) else json.dumps(_deep_merge(whole.get(a[0], {}), dotted[a[0]]))
        for a in result
    ]


def _put(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        child = tree.get(key)
        if not isinstance(child, dict):
            child = tree[key] = {}
        tree = child
    tree[path[-1]] = value


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _deep_merge(merged[key], value)
        merged[key] = value
    return merged
