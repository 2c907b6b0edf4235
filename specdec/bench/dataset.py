"""Prompt sets (JSONL lines ``{"id", "category", "turns": [...]}``) and how turns become token ids.

Multi-turn items feed the model's own reply back: turn i+1 is sent after the model's answer to
turn i, so each configuration sees its own history (identical to plain's when outputs match).

With ``chat``, turns are user messages in the model's chat template. Raw code-completion prompts
(HumanEval's ``code_completion`` category) then get an instruction in front, as EAGLE's benchmark
does: ``"Complete the code I provided.\\n\\n"`` (``--code-prefix``; an empty string turns it off).
Without ``chat``, the first turn is encoded as plain text, and later turns are appended to the
running text after the reply, separated by a blank line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# NOTE: written for specdec (code edits, extraction, chat, reasoning, a summary); taken from no
# benchmark, so that `specdec bench` runs out of the box without ../shared or a download.
DEFAULT_DATASET = Path(__file__).parent / "prompts" / "default.jsonl"
DEFAULT_CODE_PREFIX = "Complete the code I provided.\n\n"
CODE_PREFIX_CATEGORIES = ("code_completion",)
# NOTE: the benchmarks' excluded first request; in no data set, so no measured prompt repeats it.
WARMUP_PROMPT = "Warm-up request: name three colours of the rainbow, one per line."
WARMUP_CATEGORY = "warmup"


@dataclass
class BenchItem:
    id: str
    category: str
    turns: list[str]


def load_items(
    paths: Sequence[str | Path] | None,
    categories: Sequence[str] | None = None,
    num_per_category: int | None = None,
) -> list[BenchItem]:
    """Read every file in order (none: the package's default set); keep the given categories and
    the first N prompts of each."""
    items: list[BenchItem] = []
    seen: set[str] = set()
    for path in paths or [DEFAULT_DATASET]:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"dataset file not found: {path}")
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            item = _parse_line(line, f"{path}:{lineno}")
            if item.id in seen:
                raise ValueError(f"{path}:{lineno}: duplicate prompt id {item.id!r}")
            seen.add(item.id)
            items.append(item)
    if categories:
        unknown = sorted(set(categories) - {it.category for it in items})
        if unknown:
            have = ", ".join(sorted({it.category for it in items}))
            raise ValueError(
                f"no prompts in category {', '.join(unknown)}; the datasets have: {have}"
            )
        items = [it for it in items if it.category in categories]
    if num_per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for it in items:
            counts[it.category] = counts.get(it.category, 0) + 1
            if counts[it.category] <= num_per_category:
                kept.append(it)
        items = kept
    if not items:
        raise ValueError("no prompts selected")
    return items


def _parse_line(line: str, where: str) -> BenchItem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from e
    turns = row.get("turns") if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
    if "id" not in row or "category" not in row:
        raise ValueError(f"{where}: every line needs 'id' and 'category'")
    return BenchItem(str(row["id"]), str(row["category"]), turns)


def warmup_item(text: str = WARMUP_PROMPT) -> BenchItem:
    """The benchmarks' excluded first request, as a one-turn item."""
    return BenchItem("warmup", WARMUP_CATEGORY, [text])


class PromptBuilder:
    """Token ids of the prompt for turn ``i`` given the replies to turns ``0..i-1``."""

    def __init__(self, tokenizer, chat: bool, code_prefix: str = DEFAULT_CODE_PREFIX) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.code_prefix = code_prefix

    def user_text(self, item: BenchItem, turn: int) -> str:
        text = item.turns[turn]
        if self.chat and turn == 0 and item.category in CODE_PREFIX_CATEGORIES:
            text = self.code_prefix + text
        return text

    def prompt_ids(self, item: BenchItem, replies: list[str]) -> list[int]:
        turn = len(replies)
        if self.chat:
            messages: list[dict[str, str]] = []
            for i, reply in enumerate(replies):
                messages.append({"role": "user", "content": self.user_text(item, i)})
                messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "user", "content": self.user_text(item, turn)})
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True
                )
            )
        text = item.turns[0]
        for i, reply in enumerate(replies):
            text = f"{text}{reply}\n\n{item.turns[i + 1]}"
        return list(self.tokenizer.encode(text))

    def reply_text(self, token_ids: list[int]) -> str:
        """The reply as fed back: decoded without special tokens (the same for every backend)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
