"""The int8 GEMM against the machine's VNNI roof (issue 18, item 2; not a test).

Compiles ``benchmarks/gemm_roof.cpp`` with a checkout's ``kernels_vnni.cpp`` and
``kernels_portable.cpp`` (no torch; the flags of setup.py's VNNI unit) and runs it pinned to one
core:

* **roof**: 16 independent register-only ``vpdpbusd`` chains, best of many short bursts, in
  ``vpdpbusd`` per second (each 16 lanes x 4 int8 multiply-adds); re-measured around every
  format and the highest value kept;
* **GEMM**: ``linear_groups`` of the 8-bit activation kernels (Q8_0, Q4_0, Q4_1 tiles) on
  random weights of N x K (SmolLM2-135M's K: 576 and 1536), cache-resident, or with ``--copies``
  cycling through that many copies so that they stream from memory as in a forward pass; best
  of many calls in the thread's CPU time (which leaves out other processes' time slices).
  The useful work of a call is M * N * K / 64 ``vpdpbusd``; the table shows that rate as a
  percentage of the roof. Each result is checked bit for bit against the scalar twin and against
  every row computed alone.

    .venv/bin/python benchmarks/gemm_roof.py
    .venv/bin/python benchmarks/gemm_roof.py --repo /tmp/base --repo . --rounds 2   # alternate
    .venv/bin/python benchmarks/gemm_roof.py --n 8192 --ks 2048 --copies 40   # from memory
    .venv/bin/python benchmarks/gemm_roof.py --tables vnni amx1   # AMX-INT8 beside VNNI

Needs g++ and a CPU with AVX-512 VNNI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = [
    "-O3", "-g0", "-std=c++17", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c",
    "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-Wno-uninitialized",
    "-Wno-maybe-uninitialized",
]  # fmt: skip
DEFINES = ["-DSPECDEC_HAVE_AVX2", "-DSPECDEC_HAVE_AVX512", "-DSPECDEC_HAVE_VNNI"]
KINDS = {"q8_0": 1, "q4_0": 2, "q4_1": 3}


def build(repo: str, out_dir: str) -> str:
    """Compile the harness against ``repo``'s kernel sources; return the executable's path."""
    csrc = os.path.join(os.path.abspath(repo), "specdec", "kernels", "csrc")
    exe = os.path.join(out_dir, "gemm_roof")
    objs = []
    units = [("kernels_vnni.cpp", ["-mavx512vnni"]), ("kernels_portable.cpp", None)]
    defines = list(DEFINES)
    if os.path.exists(os.path.join(csrc, "kernels_amx.cpp")):
        units.append(("kernels_amx.cpp", ["-mavx512vnni", "-mamx-tile", "-mamx-int8"]))
        defines.append("-DSPECDEC_HAVE_AMX")
    for src, extra in units:
        obj = os.path.join(out_dir, src + ".o")
        flags = (
            FLAGS + extra
            if extra is not None
            else ["-O3", "-g0", "-std=c++17", "-ffp-contract=off"]
        )
        subprocess.run(
            ["g++", *flags, *defines, "-I", csrc, "-c", os.path.join(csrc, src), "-o", obj],
            check=True,
        )
        objs.append(obj)
    harness = os.path.join(HERE, "gemm_roof.cpp")
    subprocess.run(["g++", *FLAGS, *defines, "-I", csrc, harness, *objs, "-o", exe], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repo", action="append", help="checkout(s) to measure (default: this one)")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the checkouts this many times")
    ap.add_argument("--qtypes", nargs="+", default=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--ks", type=int, nargs="+", default=[576, 1536])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 64])
    ap.add_argument("--n", type=int, default=3072, help="output features (multiple of 16)")
    ap.add_argument("--seconds", type=float, default=0.15, help="per measurement")
    ap.add_argument("--copies", type=int, default=1, help="weight copies to cycle through")
    ap.add_argument("--cpu", default="1", help="taskset CPU list")
    ap.add_argument(
        "--tables",
        nargs="+",
        default=["vnni"],
        choices=["vnni", "amx", "amx1"],
        help="kernels to measure, alternated (amx: kernels_amx.cpp at its thresholds, amx1: AMX "
        "for every row count; both need a CPU with AMX-INT8)",
    )
    args = ap.parse_args()
    repos = args.repo or [os.path.dirname(HERE)]
    cases = [f"{KINDS[q]}:{k}" for q in args.qtypes for k in args.ks]
    with tempfile.TemporaryDirectory() as tmp:
        exes = {}
        for i, repo in enumerate(repos):
            os.makedirs(os.path.join(tmp, str(i)))
            exes[repo] = build(repo, os.path.join(tmp, str(i)))
        for r in range(args.rounds):
            for repo, exe in exes.items():
                for table in args.tables:
                    load = os.getloadavg()[0]
                    print(f"== {repo} {table} (round {r + 1}, load {load:.1f})", flush=True)
                    cmd = ["taskset", "-c", args.cpu, exe, str(args.n), str(args.seconds)]
                    cmd += [str(args.copies), *cases]
                    env = dict(os.environ, GEMM_TABLE=table)
                    subprocess.run([*cmd, "--ms", *map(str, args.ms)], check=True, env=env)


if __name__ == "__main__":
    main()
