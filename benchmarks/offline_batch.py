"""Offline batches: one ``LLM.generate`` over a batch of chat prompts, plain against each drafter,
every engine loaded in one process and the configurations alternated round by round (the order
rotating), so a machine whose speed drifts shifts them alike. Every output is checked token for
token against plain's.

    .venv/bin/python benchmarks/offline_batch.py --dataset chat.jsonl --batch 6 16 \\
        --configs eagle3 ngram suffix layer_skip hybrid draft_model:model=smollm2-135m

Prints one JSON line per (batch, configuration): tokens/s of each round, and the speedup as the
median of the rounds' ratios against plain's run in the same round.

--fresh runs every (round, configuration) in a new process instead (one engine, a warm-up, the
batch): identical plain engines in one process ran 4% apart over a whole run (a per-instance
offset), which alternating rounds inside one process cannot cancel, and fresh processes can.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", type=Path, required=True, help="jsonl with turns[0] per line")
    ap.add_argument("--batch", type=int, nargs="+", default=[6, 16])
    ap.add_argument("--configs", nargs="+", default=["ngram", "suffix"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup-rounds", type=int, default=1, help="whole rounds not counted")
    ap.add_argument("--fresh", action="store_true", help="each round and configuration alone")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # --fresh's worker: this label, one batch
    args = ap.parse_args()
    if args.one is not None:
        return _one(args)
    if args.fresh:
        return _fresh(args)

    from specdec import LLM, SamplingParams
    from specdec.bench.configs import parse_configs

    chats = _chats(args.dataset)
    if max(args.batch) > len(chats):
        raise SystemExit(f"--batch {max(args.batch)}: the dataset has {len(chats)} prompts")
    configs = parse_configs(args.configs)
    widest = max(args.batch)
    engines = {
        c.label: LLM(args.model, max_num_seqs=widest, speculative_config=c.speculative_config())
        for c in configs
    }
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm-up
        llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    labels = list(engines)
    for batch in args.batch:
        tps: dict[str, list[float]] = {label: [] for label in labels}
        want = None
        for rnd in range(-args.warmup_rounds, args.rounds):
            order = labels[rnd % len(labels) :] + labels[: rnd % len(labels)]
            for label in order:
                start = time.perf_counter()
                outs = engines[label].chat(chats[:batch], sp, use_tqdm=False)
                elapsed = time.perf_counter() - start
                ids = [o.outputs[0].token_ids for o in outs]
                if label == labels[0]:
                    want = want or ids
                    if ids != want:
                        raise SystemExit("plain decoding changed between rounds")
                if rnd >= 0:
                    tps[label].append(sum(len(t) for t in ids) / elapsed)
                if want is not None and label != labels[0] and ids != want:
                    raise SystemExit(f"{label}: output differs from plain at batch {batch}")
        _report(batch, labels, tps)


def _chats(path: Path) -> list[list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": r["turns"][0]}] for r in rows]


def _one(args) -> None:
    """One configuration, one batch (args.batch[0]), in this process: a JSON line."""
    from specdec import LLM, SamplingParams
    from specdec.bench.configs import parse_config

    chats = _chats(args.dataset)[: args.batch[0]]
    c = parse_config(args.one)
    llm = LLM(args.model, max_num_seqs=len(chats), speculative_config=c.speculative_config())
    llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outs = llm.chat(chats, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outs]
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    print(json.dumps({"tok_s": sum(map(len, ids)) / elapsed, "ids": digest}), flush=True)


def _fresh(args) -> None:
    from specdec.bench.configs import parse_configs

    labels = [c.label for c in parse_configs(args.configs)]
    if max(args.batch) > len(_chats(args.dataset)):
        raise SystemExit(f"--batch {max(args.batch)}: the dataset has too few prompts")
    for batch in args.batch:
        tps: dict[str, list[float]] = {label: [] for label in labels}
        want: str | None = None
        for rnd in range(-args.warmup_rounds, args.rounds):
            order = labels[rnd % len(labels) :] + labels[: rnd % len(labels)]
            for label in order:
                cmd = [sys.executable, __file__, "--model", args.model, "--dataset",
                       str(args.dataset), "--batch", str(batch), "--max-tokens",
                       str(args.max_tokens), "--one", label]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if label == labels[0]:
                    want = want or got["ids"]
                    if got["ids"] != want:
                        raise SystemExit("plain decoding changed between rounds")
                elif want is not None and got["ids"] != want:
                    raise SystemExit(f"{label}: output differs from plain at batch {batch}")
                if rnd >= 0:
                    tps[label].append(got["tok_s"])
        _report(batch, labels, tps)


def _report(batch: int, labels: list[str], tps: dict[str, list[float]]) -> None:
    for label in labels:
        ratios = [a / b for a, b in zip(tps[label], tps[labels[0]])]
        print(
            json.dumps(
                {
                    "batch": batch,
                    "config": label,
                    "tok_s": [round(x, 1) for x in tps[label]],
                    "speedup_median": round(statistics.median(ratios), 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
