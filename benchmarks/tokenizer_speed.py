"""Encode and decode speed of a GGUF file's tokenizer: the compact SentencePiece one (Gemma
vocabularies, native ``_spm_native``) against the `tokenizers` library's built for the same file,
on 100 KB texts of several kinds, and how much another thread runs meanwhile (the GIL):

    PYTHONPATH=. .venv/bin/python benchmarks/tokenizer_speed.py FILE.gguf [--kb 100]

Prints one JSON line per text kind: milliseconds per encode (best of ``--repeat``), per decode,
and the share of the encode time a spinning Python thread got (1.0: the GIL was released).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import threading
import time
from pathlib import Path

from specdec.model.gguf_file import gguf_metadata, read_gguf
from specdec.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def texts(size: int) -> dict[str, str]:
    rng = random.Random(0)
    code = "".join(p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("specdec/**/*.py")))
    prose = "".join(p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("*.md")))
    mixed = "".join(
        chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x4E00, 0x9FFF), 0x1F600 + rng.randrange(80)]))
        for _ in range(size)
    )  # fmt: skip
    return {
        "code": code[:size],
        "prose": (prose * (1 + size // max(1, len(prose))))[:size],
        "spaces": (" " * 37 + "x\n") * (size // 39),
        "one_char": "a" * size,
        "cjk_emoji_ascii": mixed,
    }


def best(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1000


def gil_share(tok: Tokenizer, text: str) -> float:
    """Iterations of a spinning thread during one encode, over its iterations in as long alone."""
    stop = False
    count = [0]

    def spin() -> None:
        while not stop:
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    t0 = time.perf_counter()
    tok.encode(text)
    elapsed = time.perf_counter() - t0
    during = count[0]
    time.sleep(elapsed)
    alone = count[0] - during
    stop = True
    t.join()
    return round(during / max(1, alone), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--kb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    metadata = gguf_metadata(read_gguf(args.model))
    sides = {
        "compact": Tokenizer.from_gguf_metadata(metadata),
        "library": Tokenizer.from_gguf_metadata(metadata, compact=False),
    }
    del metadata
    for kind, text in texts(args.kb * 1000).items():
        row: dict[str, object] = {"text": kind, "chars": len(text)}
        ids = sides["library"].encode(text)
        for name, tok in sides.items():
            assert tok.encode(text) == ids, (name, kind)
            encode = functools.partial(tok.encode, text)
            decode = functools.partial(tok.decode, ids)
            row[f"{name}_encode_ms"] = round(best(encode, args.repeat), 1)
            row[f"{name}_decode_ms"] = round(best(decode, args.repeat), 1)
            row[f"{name}_gil_share"] = gil_share(tok, text)
        row["tokens"] = len(ids)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
