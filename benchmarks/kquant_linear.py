"""One K-quant linear layer kept as K-quant tiles (8-bit activations) against the same weight
converted to Q8_0 at load, as the AVX2 loader did before kernels_avx2_kq.cpp (not a test).

Default shape: Qwen3-1.7B's gate / up projection (6144 x 2048), M = 1 (one decode row).
Weights are cold: enough copies are cycled that the working set exceeds the L3 cache.

    .venv/bin/python benchmarks/kquant_linear.py                       # q4_k, M = 1
    .venv/bin/python benchmarks/kquant_linear.py --qtype q6_k --ms 1 4 --copies 2 --seconds 0.2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specdec import kernels as K


def _kquant_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF blocks (every code pattern) with small finite f16 scales."""
    rng = np.random.default_rng(seed)
    nb, bb = k // 256, K.KQUANT_GGUF_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    scales = (rng.standard_normal((n, nb, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype == "q6_k":
        raw[..., 208:210] = scales[..., :2]
    else:
        raw[..., 0:4] = scales.reshape(n, nb, 2, 2)[..., :2, :].reshape(n, nb, 4)
    return raw.reshape(n, nb * bb)


def _time(fn, weights, x: torch.Tensor, seconds: float) -> float:
    """Median seconds per call, cycling through the weight copies."""
    for w in weights[:2]:
        fn(x, w)
    samples, start, i = [], time.perf_counter(), 0
    while i < 2 * len(weights) or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn(x, weights[i % len(weights)])
        samples.append(time.perf_counter() - t0)
        i += 1
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qtype", default="q4_k", choices=list(K.KQUANT_QTYPES))
    ap.add_argument("--n", type=int, default=6144)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--ms", type=int, nargs="+", default=[1])
    ap.add_argument("--copies", type=int, default=8, help="weight copies cycled (cold weights)")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per variant and M")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = K.get_ops("native")
    kq = [K.pack_weight(args.qtype, _kquant_blocks(args.qtype, args.n, args.k, s), args.n, args.k)
          for s in range(args.copies)]  # fmt: skip
    q8 = [K.quantize_weight(w.dequantize(), "q8_0") for w in kq]
    for w in kq:
        w.enable_a8()
    variants = {f"{args.qtype} tiles, int8 activations ({K._C.kq_kernels()})": kq,
                "q8_0 (converted), float32 activations": q8}  # fmt: skip
    rows = []
    for m in args.ms:
        x = torch.randn(m, args.k, generator=torch.Generator().manual_seed(m))
        for name, ws in variants.items():
            sec = _time(ops.linear, ws, x, args.seconds)
            gbs = ws[0].nbytes / sec / 1e9
            rows.append({"variant": name, "m": m, "ms": sec * 1e3, "weight_gb_s": gbs})
            print(f"M={m:3d}  {name:55s} {sec * 1e3:8.3f} ms  {gbs:6.1f} GB/s  "
                  f"({ws[0].nbytes / 1e6:.1f} MB)", flush=True)  # fmt: skip
    print(json.dumps({"isa": K.native_isa(), "n": args.n, "k": args.k, "rows": rows}))


if __name__ == "__main__":
    main()
