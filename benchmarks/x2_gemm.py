"""One 16-bit linear layer on the float32 kernels against the bf16x2 (AMX-BF16) ones.

    .venv/bin/python benchmarks/x2_gemm.py --threads 2

For each shape (rows M x inputs K x outputs N) and format (bf16, f16): the best of two rounds of
each kernel, the two alternating; several weight copies for the few-row shapes, so that the
weights stream from memory as in decoding.  Prints ms, weight GB/s and the speedup.
"""

from __future__ import annotations

import argparse
import time

SHAPES = [
    (512, 2048, 2048, 5, 1),
    (1, 2048, 8192, 40, 8),
    (8, 2048, 8192, 40, 8),
    (16, 2048, 8192, 20, 8),
]


def _time(ops, x, ws, reps: int) -> float:  # noqa: ANN001 (specdec and torch load in main)
    ops.linear(x, ws[0])
    t = time.perf_counter()
    for i in range(reps):
        ops.linear(x, ws[i % len(ws)])
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from specdec import kernels as K  # noqa: I001 (first: specdec sets its OpenMP environment)
    import torch

    if not K.amx16_available():
        raise SystemExit("this CPU or build has no AMX-BF16: nothing to compare")
    torch.set_num_threads(args.threads)
    ops = K.get_ops("native")
    for m, k, n, reps, copies in SHAPES:
        for name, dtype in {"bf16": torch.bfloat16, "f16": torch.float16}.items():
            flt = [
                K.pack_weight(name, (torch.randn(n, k) * 0.05).to(dtype), n, k)
                for _ in range(copies)
            ]
            x2 = [K.pack_weight(name, w.data.clone(), n, k) for w in flt]
            for w in x2:
                w.enable_x2()
            x = torch.randn(m, k)
            rounds = [(_time(ops, x, flt, reps), _time(ops, x, x2, reps)) for _ in range(2)]
            a, b = min(r[0] for r in rounds), min(r[1] for r in rounds)
            gb = n * k * 2 / 1e9
            print(
                f"M={m} K={k} N={n} {name}: float32 {a * 1e3:.2f} ms ({gb / a:.1f} GB/s), "
                f"bf16x2 {b * 1e3:.2f} ms ({gb / b:.1f} GB/s), speedup {a / b:.2f}"
            )


if __name__ == "__main__":
    main()
