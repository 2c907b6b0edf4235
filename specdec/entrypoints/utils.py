"""What every entry point shares: running a subcommand, logging, the engine from the flags, and
the sampling flags (vLLM's names with llama.cpp's spellings). Imports nothing of the other entry
points, so none of them imports another in a circle."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from specdec.config import ConfigError
from specdec.model.arch import UnsupportedModelError
from specdec.model.registry import ModelNotFoundError

LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging() -> None:
    """specdec's INFO lines (the start-up line, ignored options) on stderr."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logging.getLogger("specdec").setLevel(logging.INFO)


def run_command(func: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> int:
    """Run a subcommand; a user error becomes one line on stderr and exit code 2."""
    try:
        return int(func(args) or 0)
    except (ConfigError, ModelNotFoundError, UnsupportedModelError, ValueError) as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# (flags, dest, type, help): llama.cpp's spellings follow vLLM's / OpenAI's names
SAMPLING_FLAGS: tuple[tuple[tuple[str, ...], str, type, str], ...] = (
    (("--temperature", "--temp"), "temperature", float, "0 = greedy"),
    (("--top-p",), "top_p", float, "nucleus sampling mass"),
    (("--top-k",), "top_k", int, "-1 = off"),
    (("--min-p",), "min_p", float, "minimum probability relative to the top token's"),
    (("--repetition-penalty", "--repeat-penalty"), "repetition_penalty", float, "1 = off"),
    (("--presence-penalty",), "presence_penalty", float, "0 = off"),
    (("--frequency-penalty",), "frequency_penalty", float, "0 = off"),
)


# --chat-template NAME: templates shipped in the package (specdec/chat_templates/NAME.jinja)
BUILTIN_CHAT_TEMPLATES = ("chatml-tools",)


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's template, the template itself (vLLM's flag takes either)
    or a shipped one by name (``chatml-tools``: ChatML with Hermes tool calls); it must compile
    (a ValueError naming the flag otherwise)."""
    from pathlib import Path

    import jinja2

    from specdec.model.tokenizer import chat_template_environment

    if value in BUILTIN_CHAT_TEMPLATES:
        value = str(
            Path(__file__).parents[1] / "chat_templates" / f"{value.replace('-', '_')}.jinja"
        )
    path = Path(value)
    if "{" not in value and not path.is_file():
        raise ValueError(f"--chat-template: no such file: {value}")
    text = path.read_text() if "{" not in value else value
    try:
        chat_template_environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return text


def add_sampling_args(
    p: argparse.ArgumentParser,
    defaults: dict[str, Any],
    what: str,
    common_dests: tuple[str, ...] = (),
) -> None:
    """The sampling flags in --help's sampling section (``what`` they set); ``defaults`` per
    dest (None: not given); ``common_dests``: those the short --help shows."""
    from specdec.config import common, section_group

    group = section_group(p, "sampling")
    group.description = f"{what} (llama.cpp's spellings too)"
    for flags, dest, type_, help_ in SAMPLING_FLAGS:
        action = group.add_argument(
            *flags, dest=dest, type=type_, default=defaults.get(dest), help=help_
        )
        if dest in common_dests:
            common(action)


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags that were given (or have a default), by SamplingParams field."""
    values = {dest: getattr(args, dest, None) for _, dest, _, _ in SAMPLING_FLAGS}
    return {k: v for k, v in values.items() if v is not None}
