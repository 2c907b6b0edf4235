"""Long-prompt sets for speculation on summaries and retrieval-augmented answers, built from text
that ships with Python and Debian (never from a benchmark): the sections of the Python language
reference in ``pydoc_data.topics`` and the licence texts in /usr/share/common-licenses.

summarization: one document (a reference section or a licence, cut at a paragraph boundary to at
most --max-chars), then "summarise it".
rag: --passages paragraphs from several reference sections, shuffled (a fixed seed), and a
question about one of them, to be answered from the passages.

    python benchmarks/make_long_prompts.py --out long.jsonl --per-task 8
    specdec bench latency --model smollm2-135m --dataset long.jsonl --max-tokens 128 \\
        --configs plain suffix ngram
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
# reference sections of 4-14k characters (~1-3.5k tokens): long, prose, self-contained
SECTIONS = [
    "attribute-access",
    "customization",
    "typesmapping",
    "assignment",
    "comparisons",
    "execmodel",
    "strings",
    "import",
    "try",
    "operator-summary",
    "calls",
    "sequence-types",
    "function",
    "naming",
    "typesseq-mutable",
    "numeric-types",
]
LICENCE_FILES = ["Apache-2.0", "MPL-2.0", "LGPL-2.1", "GPL-3", "Artistic"]


def cut(text: str, max_chars: int) -> str:
    """The text up to the last paragraph break within max_chars (else the last line break)."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for sep in ("\n\n", "\n"):
        i = head.rfind(sep)
        if i > max_chars // 2:
            return head[:i].rstrip()
    return head


def paragraphs(text: str, min_chars: int = 200) -> list[str]:
    out: list[str] = []
    for p in text.split("\n\n"):
        p = p.strip()
        if out and len(out[-1]) < min_chars:
            out[-1] = out[-1] + "\n\n" + p
        elif p:
            out.append(p)
    return [p for p in out if len(p) >= min_chars]


def title(key: str) -> str:
    return key.replace("-", " ")


def summaries(topics: dict[str, str], n: int, max_chars: int) -> list[dict]:
    docs: list[tuple[str, str]] = [(k, topics[k]) for k in SECTIONS if k in topics]
    for name in LICENCE_FILES:
        path = LICENSES / name
        if path.is_file():
            docs.append((f"licence {name}", path.read_text(errors="replace")))
    rows = []
    for i, (_, text) in enumerate(docs[:n]):
        doc = cut(text, max_chars)
        prompt = (
            "Summarise the following document for a colleague who has not read it. Keep its "
            "structure, and quote its key sentences where they matter.\n\n"
            f"Document:\n{doc}\n\nSummary:"
        )
        rows.append({"id": f"summarization-{i}", "category": "summarization", "turns": [prompt]})
    return rows


def rag(topics: dict[str, str], n: int, num_passages: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    keys = [k for k in SECTIONS if k in topics]
    pool = {k: paragraphs(topics[k]) for k in keys}
    rows = []
    for i in range(n):
        target = keys[i % len(keys)]
        others = [k for k in keys if k != target]
        chosen = [(target, p) for p in pool[target][:2]]
        while len(chosen) < num_passages:
            k = rnd.choice(others)
            chosen.append((k, rnd.choice(pool[k])))
        rnd.shuffle(chosen)
        body = "\n\n".join(f"[{j + 1}] {p}" for j, (_, p) in enumerate(chosen))
        prompt = (
            "Answer the question using only the passages below; cite the passages you use by "
            f"number.\n\n{body}\n\nQuestion: What do the passages say about {title(target)}? "
            "Answer in detail."
        )
        rows.append({"id": f"rag-{i}", "category": "rag", "turns": [prompt]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--max-chars", type=int, default=9000, help="a summarised document's cap")
    ap.add_argument("--passages", type=int, default=8, help="passages per retrieval prompt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from pydoc_data.topics import topics

    rows = summaries(topics, args.per_task, args.max_chars)
    rows += rag(topics, args.per_task, args.passages, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
