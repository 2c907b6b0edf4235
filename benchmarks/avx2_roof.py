"""The AVX2 compute roofs against a verification step (issue 37's N=8 / N=1 goals; not a test).

Builds ``benchmarks/avx2_roof.cpp`` with g++ and runs it pinned to each core in turn: the int8
roof (``vpmaddubsw`` + ``vpaddw``: the inner step of the AVX2 8-bit activation kernels), the
int16 roof (``vpmaddwd`` + ``vpaddd``) and the fp32 FMA roof, per core, best of many bursts whose
chains each multiply their own operand loaded from memory.
Then, with ``--model``, times one forward over 1 and N rows (``specdec bench forward-cost``'s
measurement, in this process) and prints what the rows beyond the first would cost at the int8
roof of all cores: lower bounds on N / 1 for a step whose weights are read once (the further
rows' products after the one-row step, or every row's products hidden under the weights' reads).

    .venv/bin/python benchmarks/avx2_roof.py --model smollm2-135m --n 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def roofs(bursts: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "avx2_roof")
        subprocess.run(
            ["g++", "-O2", "-mavx2", "-mfma", "-o", exe, os.path.join(HERE, "avx2_roof.cpp")],
            check=True,
        )
        out = []
        for cpu in sorted(os.sched_getaffinity(0)):
            cmd = ["taskset", "-c", str(cpu), exe, str(bursts)]
            out.append(json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout))
        return out


def step_ms(model: str, n: int, context: int, repeats: int) -> tuple[float, float, int]:
    """Fastest one-row and n-row forwards (with logits), and the multiply-adds of one row."""
    from specdec import LLM
    from specdec.spec_decode.controller import measure_verify_cost

    llm = LLM(model, max_model_len=context + n + 64)
    m = llm.engine.model
    if m.cfg.num_experts:
        raise SystemExit("--model: a dense model (a mixture of experts reads only some experts)")
    kv = llm.engine.kv
    slot = kv.allocate()
    cost = measure_verify_cost(m, kv, slot, n, context=context, repeats=repeats)
    macs = sum(lin.weight.out_features * lin.weight.in_features for lin in m.linears())
    return cost.verify_ms[0], cost.verify_ms[n - 1], macs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bursts", type=int, default=300)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    per_core = roofs(args.bursts)
    int8 = sum(r["int8_macs_per_s"] for r in per_core)
    result = {
        "cores": len(per_core),
        "int8_gmacs_per_core": [round(r["int8_macs_per_s"] / 1e9, 1) for r in per_core],
        "int16_gmacs_per_core": [round(r["int16_macs_per_s"] / 1e9, 1) for r in per_core],
        "fp32_gmacs_per_core": [round(r["fp32_macs_per_s"] / 1e9, 1) for r in per_core],
    }
    if args.model:
        one, n_ms, macs = step_ms(args.model, args.n, args.context, args.repeats)
        extra = (args.n - 1) * macs / int8 * 1e3  # ms, the further rows at the int8 roof
        result.update(
            model=args.model,
            macs_per_row=macs,
            n=args.n,
            one_row_ms=round(one, 2),
            n_rows_ms=round(n_ms, 2),
            measured_ratio=round(n_ms / one, 2),
            further_rows_gmacs=round((args.n - 1) * macs / (n_ms - one) / 1e6, 1),
            roof_extra_ms=round(extra, 2),
            # the further rows' products after the first row's step, or all n rows' products
            # overlapping the weights' reads (the one-row step's time): the two bounds
            roof_ratio_serial=round((one + extra) / one, 2),
            roof_ratio_overlap=round(max(one, args.n * macs / int8 * 1e3) / one, 2),
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
