"""Code edits of this repository's own source, plain decoding against a speculative method (not a
test): each edit asks the model to rewrite a piece of a file with one change, greedy, at batch 1,
each configuration in its own process after a warm-up request, the configurations alternated
``--rounds`` times. Prints tokens per second per edit and overall, the speedup, and whether every
output equals plain decoding's (it must).

The edits are written here, not taken from a benchmark set, so they can be measured on any
machine without ``../shared/bench/data``.

    .venv/bin/python benchmarks/code_edits.py --model smollm2-135m --method suffix --rounds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (file, start, end, request): the piece of the file between the two offsets, and the change
EDITS = [
    ("specdec/engine/fair_share.py", 3000, 5200,
     "Rename the variable `share` to `portion` everywhere in this Python code."),
    ("specdec/kv_cache/memory.py", 2600, 4600,
     "Add a type hint `-> None` to every function that returns nothing in this Python code."),
    ("specdec/model/layers.py", 5200, 7000,
     "Rename `inv_freq` to `inverse_frequencies` in this Python code."),
    ("benchmarks/trees_ab.py", 1200, 3000,
     "Replace every double-quoted string with a single-quoted one in this Python code."),
]  # fmt: skip


def _run(model: str, method: str, max_tokens: int) -> dict:
    """In a child process: every edit once, greedy; tokens, seconds and token ids per edit."""
    from specdec import LLM, SamplingParams

    kw = {} if method == "plain" else {"speculative_config": {"method": method}}
    llm = LLM(model, max_model_len=4096, max_num_seqs=1, **kw)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat([{"role": "user", "content": "Say hello in Python."}], sp, use_tqdm=False)
    rows = []
    for path, start, end, ask in EDITS:
        code = (ROOT / path).read_text()[start:end]
        prompt = f"{ask} Output only the code.\n\n```python\n{code}\n```"
        t0 = time.perf_counter()
        out = llm.chat([{"role": "user", "content": prompt}], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ids = list(out[0].outputs[0].token_ids)
        rows.append({"edit": path, "tokens": len(ids), "seconds": seconds, "ids": ids})
    return {"method": method, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_run(args.model, args.child, args.max_tokens)))
        return
    results: dict[str, list[dict]] = {"plain": [], args.method: []}
    for r in range(args.rounds):
        order = ["plain", args.method] if r % 2 == 0 else [args.method, "plain"]
        for method in order:
            cmd = [sys.executable, __file__, "--model", args.model, "--child", method,
                   "--max-tokens", str(args.max_tokens)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[method].append(json.loads(out.strip().splitlines()[-1]))
    same = all(
        a["ids"] == b["ids"]
        for p, s in zip(results["plain"], results[args.method])
        for a, b in zip(p["rows"], s["rows"])
    )
    print(f"| edit | plain tok/s | {args.method} tok/s | speedup |")
    print("|---|---|---|---|")
    for i, (path, *_rest) in enumerate(EDITS):
        rates = {
            m: [run["rows"][i]["tokens"] / run["rows"][i]["seconds"] for run in runs]
            for m, runs in results.items()
        }
        plain, other = max(rates["plain"]), max(rates[args.method])
        print(f"| {path} | {plain:.1f} | {other:.1f} | {other / plain:.2f}x |")
    for r in range(args.rounds):
        tok = {m: sum(x["tokens"] for x in runs[r]["rows"]) for m, runs in results.items()}
        sec = {m: sum(x["seconds"] for x in runs[r]["rows"]) for m, runs in results.items()}
        plain, other = tok["plain"] / sec["plain"], tok[args.method] / sec[args.method]
        print(f"round {r + 1}: plain {plain:.1f} tok/s, {args.method} {other:.1f} tok/s, "
              f"{other / plain:.2f}x")  # fmt: skip
    print("every output identical to plain:", same)


if __name__ == "__main__":
    main()
