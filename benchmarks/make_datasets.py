"""Build the benchmark prompt sets used in BENCHMARKS.md from ../shared/bench/data.

mixed.jsonl: N prompts from each file (spread over its sub-categories), category = the file.
repeated.jsonl: the first M stdlib_edit prompts twice (categories pass1 / pass2), the repeated-task
workload where suffix decoding's global tree pays.

    python benchmarks/make_datasets.py --per-file 5 --repeat 10 --out bench_out/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FILES = {
    "stdlib_edit": "stdlib_edit.jsonl",
    "humaneval": "humaneval.jsonl",
    "mt_bench": "mt_bench.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
}


def spread(rows: list[dict], n: int) -> list[dict]:
    """n rows taken round-robin over the file's own categories, first ones first."""
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row)
    out: list[dict] = []
    i = 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out.extend(v[i] for v in by_cat.values() if i < len(v))
        i += 1
    return out[:n]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "bench" / "data")
    )
    p.add_argument("--per-file", type=int, default=5)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out", default="bench_out/data")
    args = p.parse_args()
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "mixed.jsonl").open("w") as f:
        for name, file in FILES.items():
            rows = [json.loads(line) for line in (data / file).read_text().splitlines() if line]
            for row in spread(rows, args.per_file):
                turns = row["turns"][:1]  # first turns only (mt_bench has two)
                f.write(json.dumps({"id": row["id"], "category": name, "turns": turns}) + "\n")
    stdlib = [
        json.loads(line) for line in (data / FILES["stdlib_edit"]).read_text().splitlines() if line
    ]
    with (out / "repeated.jsonl").open("w") as f:
        for pass_name in ("pass1", "pass2"):
            for row in stdlib[: args.repeat]:
                item = {
                    "id": f"{row['id']}/{pass_name}",
                    "category": pass_name,
                    "turns": row["turns"],
                }
                f.write(json.dumps(item) + "\n")
    print(f"wrote {out / 'mixed.jsonl'} and {out / 'repeated.jsonl'}")


if __name__ == "__main__":
    main()
