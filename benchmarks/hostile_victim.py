"""How much a costly or hostile request slows everyone else (issue 30's budgets).

Starts `specdec serve MODEL` (a subprocess, suffix speculation unless --spec none), then for each
case: a victim stream (greedy, ignore_eos, N tokens) runs alone, then again while the case's
requests run beside it (with ``--loop``: each sent again, under a fresh ``cache_salt`` so that
nothing comes from the prefix cache, until the victim's stream ends). Prints, per case, the victim's median and p90 time between streamed
tokens alone and loaded, their ratio, the case's HTTP statuses, its wall time, and the longest
/health gap seen while it ran. Alternates alone / loaded runs ``--rounds`` times.

    .venv/bin/python benchmarks/hostile_victim.py [--model smollm2-135m] [--cases a,b] [--rounds 2]
        [--server-path ../older-checkout] [--loop] [--extra-args "--prefill-time-share 0"]

Run on a quiet machine (nothing else on the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.hostile import CASES  # noqa: E402
from tests.fixtures.victim import beside, victim  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    model: str, spec: str, server_path: Path, extra: list[str]
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "specdec", "serve", model, "--port", str(port),
           "--max-model-len", "4096", "--uvicorn-log-level", "warning"]  # fmt: skip
    if spec != "none":
        cmd += ["--speculative-config", json.dumps({"method": spec})]
    cmd += extra
    env = {**os.environ, "SPECDEC_API_KEY": "", "PYTHONPATH": str(server_path)}
    proc = subprocess.Popen(cmd, cwd=server_path, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def _health_gap(url: str, stop: threading.Event, out: list[float]) -> None:
    last, worst = time.perf_counter(), 0.0
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            c.get(f"{url}/health")
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
            time.sleep(0.01)
    out.append(worst)


def _run_case(url: str, model: str, name: str, n: int, loop: bool = False) -> dict:
    stop, gap = threading.Event(), []
    watcher = threading.Thread(target=_health_gap, args=(url, stop, gap))
    watcher.start()
    try:
        run = beside(url, model, CASES[name], n, loop=loop, loop_s=300, timeout=300)
    finally:
        stop.set()
        watcher.join()
    statuses = [s.status for s in run.sent]
    statuses = sorted(set(statuses)) if loop else statuses
    return {"gaps": run.stream.gaps, "statuses": statuses, "wall": run.wall, "health_gap": gap[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default="suffix", help="a method, or none")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tokens", type=int, default=150, help="victim stream length")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loop", action="store_true", help="resend each case's requests (new salts)")
    ap.add_argument("--extra-args", default="", help="more `specdec serve` arguments")
    ap.add_argument(
        "--server-path",
        type=Path,
        default=REPO,
        help="the checkout whose specdec serves (an older one, for a before/after)",
    )
    args = ap.parse_args()
    proc, url = _start(args.model, args.spec, args.server_path.resolve(), args.extra_args.split())
    try:
        victim(url, args.model, 16)  # warm up
        print("| case | statuses | case wall s | victim ms/token alone (median, p90) | loaded "
              "| loaded / alone (median) | longest gap / alone median | /health max gap ms |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for name in args.cases.split(","):
            alone, loaded, res = [], [], None
            for _ in range(args.rounds):
                alone += victim(url, args.model, args.tokens).gaps
                res = _run_case(url, args.model, name, args.tokens, args.loop)
                loaded += res["gaps"]
            a50, a90 = statistics.median(alone), statistics.quantiles(alone, n=10)[-1]
            worst = max(loaded) / a50
            l50, l90 = statistics.median(loaded), statistics.quantiles(loaded, n=10)[-1]
            print(f"| {name} | {res['statuses']} | {res['wall']:.1f} | {a50 * 1e3:.1f}, "
                  f"{a90 * 1e3:.1f} | {l50 * 1e3:.1f}, {l90 * 1e3:.1f} | {l50 / a50:.2f} | "
                  f"{worst:.1f} | {res['health_gap'] * 1e3:.0f} |", flush=True)  # fmt: skip
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server (it drains), then kill it if it has not exited in 20 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
    main()
