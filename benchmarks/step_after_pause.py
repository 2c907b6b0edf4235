"""What a decode step costs right after the cores did something else: the same stream's step
back to back, after a pause (``time.sleep``), and after busy work of one thread, for each pause
length; and a read of a 64 MiB buffer in 4 KiB pages against huge pages the same ways.

Why: beside a long prompt, a stream's decode-only steps come between prefill chunks of ~20 ms
and run slower than the same stream's steps back to back (the machine, not the scheduler: a step
after any 15+ ms of other work or sleep is slower on a virtual machine whose caches and page
walks another tenant shares). ``benchmarks/prefill_share.py`` counts its gaps in the back-to-back
steps, so this is the floor under its "x idle" figures on the machine it ran on.

    .venv/bin/python benchmarks/step_after_pause.py --model smollm2-135m --pauses 0 2 20 50

Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import time

import numpy as np

from specdec import LLM, SamplingParams


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _steps(engine, pause: float, how: str, steps: int, tag: str) -> float:
    """Median decode step (ms) of one greedy stream, each step after ``pause`` seconds of ``how``."""
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request("Once upon a time", sp, tag)
    times = []
    while engine.has_unfinished_requests():
        if pause:
            time.sleep(pause) if how == "sleep" else _busy(pause)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[4:])


def _buffer(nbytes: int, huge: bool):  # -> (mmap, torch.Tensor)
    import torch  # NOTE: after specdec (OMP_WAIT_POLICY)

    m = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    pad = -a.ctypes.data % (2 << 20)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, pad, nbytes)
    a = a[pad : pad + nbytes]
    a[:] = 1
    return m, torch.from_numpy(a).view(torch.float32)


def _reads(t, pause: float, how: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if pause:
            time.sleep(pause) if how == "sleep" else _busy(pause)
        start = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pauses", type=float, nargs="+", default=[0, 2, 20, 50], metavar="MS")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=1024, max_num_seqs=1)
    engine = llm.llm_engine
    rows = []
    for i, ms in enumerate(args.pauses):
        for how in ("sleep", "busy"):
            step = _steps(engine, ms / 1e3, how, args.steps, f"{how}{i}")
            rows.append({"what": "decode step", "pause_ms": ms, "how": how, "ms": step})
    import torch

    torch.set_num_threads(1)
    for huge in (False, True):
        _, t = _buffer(64 << 20, huge)
        for ms in args.pauses:
            for how in ("sleep", "busy"):
                read = _reads(t, ms / 1e3, how, 30)
                what = "64 MiB read, " + ("huge pages" if huge else "4 KiB pages")
                rows.append({"what": what, "pause_ms": ms, "how": how, "ms": read})
    base: dict[str, float] = {}
    print("| what | pause ms | during the pause | ms | x back to back |")
    print("|---|---|---|---|---|")
    for r in rows:
        base.setdefault(r["what"], r["ms"])
        r["x"] = r["ms"] / base[r["what"]]
        print(f"| {r['what']} | {r['pause_ms']:g} | {r['how']} | {r['ms']:.2f} | {r['x']:.2f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
