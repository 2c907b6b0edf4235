"""How long a small structured request waits behind another client's slow grammars.

Starts `specdec serve MODEL` (as hostile_victim.py), then per count K: K slow constraints (JSON
schemas of a 40,000-value enum, ~0.9 MB: ~0.6 s to check and as long to build, each) sent at once, and 0.3 s later a small ``json_schema`` chat
request; prints the small request's latency against the same request alone, and the slow ones'
statuses and wall time. ``--server-path`` serves from another checkout (a before/after).

    .venv/bin/python benchmarks/grammar_lanes.py [--counts 2,6] [--server-path /tmp/base]

Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hostile_victim import _start, _stop  # noqa: E402

SMALL = {
    "messages": [{"role": "user", "content": "Give me a JSON object with a number a."}],
    "max_tokens": 8,
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "n",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    },
}


def _slow(i: int) -> dict:
    values = [f"value {i} {j} t{j * 7 % 1000}" for j in range(40_000)]
    return {"prompt": "x", "max_tokens": 2, "guided_json": {"type": "string", "enum": values}}


def _timed(url: str, path: str, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/{path}", json=body, timeout=120)
    return time.perf_counter() - t0, r.status_code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--counts", default="2,6")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--server-path", type=Path, default=REPO)
    args = ap.parse_args()
    proc, url = _start(args.model, "none", args.server_path.resolve(), [])
    try:
        small = {"model": args.model, **SMALL}
        _timed(url, "chat/completions", small)  # warm up
        print(
            "| slow grammars | small alone s | small beside them s | slow statuses | slow wall s |"
        )
        print("|---|---|---|---|---|")
        for k in [int(c) for c in args.counts.split(",")]:
            for r in range(args.rounds):
                alone, _ = _timed(url, "chat/completions", small)
                with ThreadPoolExecutor(k + 1) as pool:
                    slow = [
                        pool.submit(_timed, url, "completions", {"model": args.model, **_slow(i)})
                        for i in range(k * (r + 1), k * (r + 2))
                    ]
                    time.sleep(0.3)
                    beside, status = _timed(url, "chat/completions", small)
                    done = [f.result() for f in slow]
                statuses = sorted({s for _, s in done})
                print(f"| {k} | {alone:.2f} | {beside:.2f} ({status}) | {statuses} | "
                      f"{max(t for t, _ in done):.1f} |", flush=True)  # fmt: skip
    finally:
        _stop(proc)


if __name__ == "__main__":
    main()
