"""Benchmark of the native linear kernels against torch's fp32 F.linear (not a test).

Shapes are SmolLM2-135M's linear layers (hidden 576, 3 kv heads x 64, MLP 1536, vocab 49152).
Weights are "cold" by default: several copies are cycled so the working set exceeds the L3
cache, as in a real forward pass where each layer's weight comes from memory.  GB/s is the
weight storage read per call divided by the call time.

    .venv/bin/python benchmarks/kernels_bench.py                    # everything, 2 threads
    .venv/bin/python benchmarks/kernels_bench.py --qtypes q4_1 --ms 1 4 --shapes 576x576
    .venv/bin/python benchmarks/kernels_bench.py --step      # + a kernel-only forward step

--step also times a synthetic SmolLM2-135M forward made only of these kernels (random weights;
30 layers of rms_norm, fused QKV, attention over 200 cached positions, o, rms_norm, fused
gate/up, SiLU, down; then the 49152-row output layer in Q8_0, or f32 for f32), per qtype and M.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from specdec import kernels

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
# Calls per SmolLM2-135M forward: 30 layers x (q, o: 576x576; k, v: 192x576; gate, up: 1536x576;
# down: 576x1536) + the output layer.
STEP_CALLS = {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30, (49152, 576): 1}


def _time(fn, args_list, min_time: float, min_iters: int, stat: str) -> float:
    """Seconds per call (median or min) over ~min_time, cycling through args_list."""
    for a in args_list[:2]:
        fn(*a)
    samples: list[float] = []
    start = time.perf_counter()
    i = 0
    while i < min_iters or time.perf_counter() - start < min_time:
        a = args_list[i % len(args_list)]
        t0 = time.perf_counter()
        fn(*a)
        samples.append(time.perf_counter() - t0)
        i += 1
    return min(samples) if stat == "min" else statistics.median(samples)


def _step_model(qtype: str, n_layers: int = 30):
    hid, heads, kv_heads, hd, inter = 576, 9, 3, 64, 1536
    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int, qt: str = qtype) -> kernels.PackedWeight:
        return kernels.quantize_weight(torch.randn(n, k, generator=g) * 0.05, qt)

    layers = [
        {
            "qkv": weight((heads + 2 * kv_heads) * hd, hid),
            "o": weight(hid, heads * hd),
            "gate_up": weight(2 * inter, hid),
            "down": weight(hid, inter),
            "k": torch.randn(kv_heads, 1024, hd, generator=g),
            "v": torch.randn(kv_heads, 1024, hd, generator=g),
        }
        for _ in range(n_layers)
    ]
    out = weight(49152, hid, "f32" if qtype == "f32" else "q8_0")
    norm = torch.ones(hid)

    def step(ops: kernels.KernelOps, x: torch.Tensor, pos: int = 200) -> torch.Tensor:
        m = x.shape[0]
        for ly in layers:
            h = ops.rms_norm(x, norm, 1e-5)
            q = ops.linear(h, ly["qkv"])[:, : heads * hd].reshape(m, heads, hd)
            a = ops.attention(q, ly["k"], ly["v"], pos, hd**-0.5)
            x = x + ops.linear(a.reshape(m, heads * hd), ly["o"])
            gu = ops.linear(ops.rms_norm(x, norm, 1e-5), ly["gate_up"])
            x = x + ops.linear(F.silu(gu[:, :inter]) * gu[:, inter:], ly["down"])
        return ops.linear(ops.rms_norm(x, norm, 1e-5), out)

    return step


def run_steps(args, ops: kernels.KernelOps) -> None:
    print("\nKernel-only SmolLM2-135M-shaped forward step (ms, 200 cached positions):")
    print(" " * 10 + "  " + "  ".join(f"M={m:<5d}" for m in args.ms))
    for qtype in args.qtypes:
        step = _step_model(qtype)
        cells = []
        for m in args.ms:
            x = torch.randn(m, 576)
            sec = _time(step, [(ops, x)], max(args.min_time, 0.5), 5, args.stat)
            cells.append(f"{sec * 1e3:7.2f}")
        print(f"{qtype:>10s}  " + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--qtypes", nargs="+", default=list(kernels.QTYPES))
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK")
    ap.add_argument("--isa", default="auto", help="native kernels: auto, avx512, avx2, portable")
    ap.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-resident)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="per-call statistic; 'min' is steadier on a machine shared with other work",
    )
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--step", action="store_true", help="also time a kernel-only forward step")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not kernels.native_available():
        raise SystemExit(f"native kernels unavailable: {kernels.native_unavailable_reason()}")
    kernels.set_native_isa(args.isa)
    ops = kernels.get_ops("native")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, native isa {kernels.native_isa()}, "
        f"cpu {kernels.cpu_features()}, weights {'hot' if args.hot else 'cold'}, {args.stat} of calls"
    )
    results = []
    step_ms: dict[str, dict[int, float]] = {}
    for n, k in shapes:
        w = torch.randn(n, k) * 0.05
        print(f"\n== {n}x{k} ==  " + "  ".join(f"M={m:<2d} ms   GB/s" for m in args.ms))
        for label in ["torch_f32", *args.qtypes]:
            qtype = "f32" if label == "torch_f32" else label
            packed = kernels.quantize_weight(w, qtype)
            # ~128 MiB of copies: four times the 32 MiB L3 of the development machine.
            copies = 1 if args.hot else max(1, -(-(128 << 20) // packed.nbytes))
            ws = [packed] + [
                kernels.PackedWeight(qtype, n, k, packed.data.clone()) for _ in range(copies - 1)
            ]
            cells = []
            for m in args.ms:
                x = torch.randn(m, k)
                if label == "torch_f32":
                    sec = _time(F.linear, [(x, p.data) for p in ws], args.min_time, 5, args.stat)
                else:
                    sec = _time(ops.linear, [(x, p) for p in ws], args.min_time, 5, args.stat)
                gbs = packed.nbytes / sec / 1e9
                cells.append(f"{sec * 1e3:7.3f} {gbs:6.1f}")
                results.append(
                    {"shape": [n, k], "impl": label, "m": m, "ms": sec * 1e3, "gbps": gbs}
                )
                if (n, k) in STEP_CALLS:
                    step_ms.setdefault(label, {}).setdefault(m, 0.0)
                    step_ms[label][m] += STEP_CALLS[(n, k)] * sec * 1e3
            print(f"{label:>10s}  " + "  ".join(cells))
            del ws
    if all(s in STEP_CALLS for s in shapes) and len(shapes) == len(STEP_CALLS):
        print("\nAll linear layers of one SmolLM2-135M forward (ms, same qtype everywhere):")
        print(" " * 10 + "  " + "  ".join(f"M={m:<5d}" for m in args.ms))
        for label, per_m in step_ms.items():
            print(f"{label:>10s}  " + "  ".join(f"{per_m[m]:7.2f}" for m in args.ms))
    if args.step:
        run_steps(args, ops)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": args.threads, "isa": kernels.native_isa(), "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
