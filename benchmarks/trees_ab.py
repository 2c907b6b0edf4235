"""One target step (forward + logits over N new rows at a fixed context), two source trees side by
side: each (round, tree, case) in a fresh process importing ``specdec`` from that tree, the trees'
order alternating round by round. For a change to the kernels or the model, measured before and
after on the same machine in one run.

    git worktree add /tmp/base HEAD~1 && (cd /tmp/base && python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/trees_ab.py --trees /tmp/base . --cases 200:1 2000:1 200:8
    .venv/bin/python benchmarks/trees_ab.py --trees /tmp/base . --kv-cache-dtype int8 --cases 2000:8

Prints each process's step-time quantiles (ms over ``--seconds`` of back-to-back steps), then per
case the speed-up of the second tree over the first (first / second) per round, on the medians
and on the minima, and their medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def _one(tree: str, model: str, context: int, n: int, seconds: float, kv_dtype: str) -> dict:
    """In the worker process: time steps of ``model`` with ``specdec`` imported from ``tree``."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, tree)
    import time

    import specdec

    if not Path(specdec.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"specdec came from {specdec.__file__}, not {tree}")
    import torch

    from specdec import LLM
    from specdec.model.llama import SeqBatch

    llm = LLM(model, max_model_len=context + n + 16, max_num_seqs=1, kv_cache_dtype=kv_dtype)
    m = llm.engine.model
    kv = m.make_kv_cache(1, context + n + 8)
    gen = torch.Generator().manual_seed(0)
    vocab = m.cfg.vocab_size
    m.forward(
        torch.randint(0, vocab, (context,), generator=gen),
        torch.arange(context),
        SeqBatch([0], [0], [context]),
        kv,
    )
    try:  # a long context's KV in huge pages before the timed steps, in trees that defer it
        from specdec.kv_cache.memory import settle_huge_pages
    except ImportError:
        pass
    else:
        settle_huge_pages()
    times: list[float] = []
    pos = torch.arange(context, context + n)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        start = time.perf_counter()
        logits = m.compute_logits(m.forward(ids, pos, SeqBatch([0], [context], [n]), kv))
        float(logits[-1, 0])  # NOTE: the work is done before the clock stops
        times.append(time.perf_counter() - start)
    times.sort()

    def q(f: float) -> float:
        return round(1000 * times[int(f * (len(times) - 1))], 3)

    return {"steps": len(times), "min": q(0), "p25": q(0.25), "p50": q(0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cases", nargs="+", default=["200:1", "2000:1", "200:8"], help="CONTEXT:N")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=6.0, help="of steps per process")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as the engine's option")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # worker: TREE CONTEXT N SECONDS
    args = ap.parse_args()
    if args.one:
        tree, context, n, seconds = args.one
        print(
            json.dumps(
                _one(tree, args.model, int(context), int(n), float(seconds), args.kv_cache_dtype)
            )
        )
        return
    if not args.trees:
        ap.error("--trees BEFORE AFTER is required")
    trees = [str(Path(t).resolve()) for t in args.trees]
    cases = [tuple(int(v) for v in c.split(":")) for c in args.cases]
    got: dict[tuple, dict] = {}
    for rnd in range(args.rounds):
        order = trees if rnd % 2 == 0 else trees[::-1]
        for tree in order:
            for context, n in cases:
                cmd = [sys.executable, __file__, "--model", args.model]
                cmd += ["--kv-cache-dtype", args.kv_cache_dtype, "--one", tree]
                cmd += [str(context), str(n), str(args.seconds)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                got[(rnd, tree, context, n)] = res
                print(json.dumps({"round": rnd, "tree": tree, "context": context, "n": n, **res}))
    for context, n in cases:
        summary = {"context": context, "n": n}
        for stat in ("p50", "min"):
            ratios = [
                got[(r, trees[0], context, n)][stat] / got[(r, trees[1], context, n)][stat]
                for r in range(args.rounds)
            ]
            summary[f"speedup_{stat}"] = [round(x, 3) for x in ratios]
            summary[f"speedup_{stat}_median"] = round(statistics.median(ratios), 3)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
