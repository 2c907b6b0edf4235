"""A model by hub id against its cached copy: the stand-in hub (tests/fixtures/fake_hub.py) on
loopback serves the SmolLM2 Q4_1 GGUF (94 MiB), and each run, in a fresh cache folder, times
in fresh processes:

- ``download``: ``LLM("acme/SmolLM2-GGUF:Q4_1")``, the cache empty (list, download, load);
- ``cached``: ``LLM(path)`` on the cached copy that download left (the file, read as any local);
- ``second``: ``LLM("acme/SmolLM2-GGUF:Q4_1")`` again: from the cache, ``hub_requests`` counts
  what it asked the hub (the goal: none).

    PYTHONPATH=. .venv/bin/python benchmarks/hub_load.py [--runs 5] [--weight-cache] [--cdn]

Each time is ``LLM(...)`` alone (specdec and huggingface_hub imported before the clock starts);
``resolve_s`` is its share spent finding or downloading the file (``hub_model_path``).
``--weight-cache`` lets specdec's weight cache act as in any run (written by the download,
read by the later loads); by default it is off, so every load repacks the file the same way.
``--cdn``: the GGUF's ``resolve`` answers a 302 to the stand-in CDN (another origin), as
huggingface.co's does for an LFS file.

Where the download's extra time goes (2-vCPU Xeon VM, weight cache off, 4 rounds of 5 runs
alternated with the code before): 0.33 s against 0.20-0.21 s for the cached copy (1.55-1.65x).
The extra ~0.12 s: the download's two modules (~5 ms, compiled from source where
PYTHONDONTWRITEBYTECODE is set), three requests (model_info, the tree, the file's GET) ~6 ms, the
transfer ~0.06 s (512 KiB ``readinto`` pieces written with ``pwrite``; a bare socket does about
the same), its sha256 alongside in a thread ~0.05 s more (the two vCPUs are shared by the stand-in
hub's sendfile, the transfer and the hash), the blob's rename and link ~1 ms. Before, through
huggingface_hub's snapshot_download: 0.48-0.55 s (2.4-2.7x): importing its API ~0.08 s, the
transfer through httpx (64 KiB reads) 0.14-0.16 s, four requests. ``second`` reads the cache's
layout without importing huggingface_hub or the download's modules: as ``cached``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO, MODEL, NAME = (
    "acme/SmolLM2-GGUF",
    "acme/SmolLM2-GGUF:Q4_1",
    "SmolLM2-135M-Instruct-Q4_1.gguf",
)


def child(model: str) -> None:
    """One load in this (fresh) process; prints {total_s, resolve_s, path} as JSON."""
    import huggingface_hub  # noqa: F401  NOTE: the download before used it: not timed in either

    import specdec.model.hub as hub
    from specdec import LLM

    resolved: dict[str, float | str] = {}
    inner = hub.hub_model_path

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        path = inner(*args, **kwargs)
        resolved.update(resolve_s=time.perf_counter() - start, path=str(path))
        return path

    hub.hub_model_path = timed
    start = time.perf_counter()
    llm = LLM(model, max_model_len=128, max_num_seqs=1)
    total = time.perf_counter() - start
    print(json.dumps({"total_s": total, "resolve_s": resolved.get("resolve_s", 0.0),
                      "path": resolved.get("path", model)}))  # fmt: skip
    del llm


def _run(model: str, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", model], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"child failed ({model}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--weight-cache", action="store_true")
    ap.add_argument("--cdn", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from specdec.model.registry import _smollm2_path
    from tests.fixtures.fake_hub import FakeHub, HubServer

    hub = FakeHub(cdn=args.cdn)
    hub.add(REPO, {NAME: _smollm2_path(), "README.md": b"# SmolLM2"})
    times: dict[str, list[float]] = {"download": [], "cached": [], "second": []}
    resolve: dict[str, list[float]] = {k: [] for k in times}
    second_requests = []
    with HubServer(hub), tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            home = Path(tmp) / f"hf-{run}"
            env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home),
                   "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": str(Path(__file__).parents[1])}  # fmt: skip
            for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
                env.pop(name, None)
            env["SPECDEC_WEIGHT_CACHE"] = str(home / "weights") if args.weight_cache else "off"
            first = _run(MODEL, env)
            cached = _run(first["path"], env)
            before = len(hub.requests)
            second = _run(MODEL, env)
            second_requests.append(len(hub.requests) - before)
            for key, res in (("download", first), ("cached", cached), ("second", second)):
                times[key].append(res["total_s"])
                resolve[key].append(res["resolve_s"])
    size = _smollm2_path().stat().st_size
    report = {
        "file_mib": round(size / 2**20, 1),
        "runs": args.runs,
        "weight_cache": args.weight_cache,
        "cdn": args.cdn,
        **{
            key: {
                "min_s": round(min(v), 3),
                "median_s": round(statistics.median(v), 3),
                "resolve_median_s": round(statistics.median(resolve[key]), 3),
            }
            for key, v in times.items()
        },
        "ratio_median": round(statistics.median(times["download"]) / statistics.median(times["cached"]), 2),
        "ratio_min": round(min(times["download"]) / min(times["cached"]), 2),
        "second_hub_requests": second_requests,
    }  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
