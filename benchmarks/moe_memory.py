"""Memory and load time of a mixture-of-experts GGUF (issue 34's goals: RSS after loading <= 1.1x
the file size; load time <= 2x llama.cpp's), specdec against llama.cpp, each in its own process,
alternating rounds:

    .venv/bin/python benchmarks/moe_memory.py bench_out/synthetic/qwen3-30b-a3b-8l-Q4_K_M.gguf

specdec: ``benchmarks/load_memory.py specdec FILE`` (``LLM(file, max_model_len=512,
max_num_seqs=1)``: load time including the import, RSS after load, peak RSS). llama.cpp:
``llama-bench -m FILE -p 0 -n 1 -r 1 -t 2`` timed as a whole process (its load, its warm-up and
one token: an upper bound on its load time) with its peak RSS (mmap on, llama.cpp's default).
The first round also warms the page cache; the table gives every round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BENCH = Path("/work/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench")


def specdec_load(model: str) -> dict:
    """One fresh process loading the file (load_memory.py's JSON line)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load_memory.py"), "specdec", model],
        env=env, check=True, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_load(model: str, llama_bench: Path, threads: int) -> dict:
    """llama-bench over no prompt and one token: the whole process's seconds and peak RSS."""
    cmd = [str(llama_bench), "-m", model, "-p", "0", "-n", "1", "-r", "1", "-t", str(threads)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        last = err.strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"llama-bench failed ({proc.returncode}): {last[0]}")
    return {"process_s": round(seconds, 2), "peak_gib": round(usage.ru_maxrss / 2**20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama-bench's threads")
    ap.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    file_gib = os.path.getsize(args.model) / 2**30
    rounds = []
    for i in range(args.rounds):
        # NOTE: alternate which engine goes first, so the page cache favours neither
        pair = {}
        for engine in ("specdec", "llama.cpp") if i % 2 == 0 else ("llama.cpp", "specdec"):
            if engine == "specdec":
                pair[engine] = specdec_load(args.model)
            else:
                pair[engine] = llama_cpp_load(args.model, args.llama_bench, args.threads)
        rounds.append(pair)
        s, c = pair["specdec"], pair["llama.cpp"]
        print(
            f"round {i}: specdec load {s['load_s']} s (model {s['model_s']} s), RSS "
            f"{s['rss_gib']} GiB, peak {s['peak_gib']} GiB | llama.cpp process "
            f"{c['process_s']} s, peak {c['peak_gib']} GiB"
        )
    load = statistics.median(r["specdec"]["load_s"] for r in rounds)
    model_s = statistics.median(r["specdec"]["model_s"] for r in rounds)
    rss = statistics.median(r["specdec"]["rss_gib"] for r in rounds)
    ref = statistics.median(r["llama.cpp"]["process_s"] for r in rounds)
    summary = {
        "file_gib": round(file_gib, 2),
        "specdec_load_s": load,
        "specdec_model_s": model_s,  # the load without the import
        "specdec_rss_gib": rss,
        "rss_over_file": round(rss / file_gib, 3),
        "llama_cpp_process_s": ref,
        "load_over_llama_cpp": round(load / ref, 3),
    }
    print(
        f"file {file_gib:.2f} GiB: RSS after load {rss:.2f} GiB = {summary['rss_over_file']:.2f}x "
        f"the file (goal <= 1.1); load {load:.1f} s = {summary['load_over_llama_cpp']:.2f}x "
        f"llama.cpp's {ref:.1f} s (goal <= 2; llama.cpp's includes a warm-up and one token); "
        f"without the import {model_s:.1f} s = {model_s / ref:.2f}x"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
