"""Forward cost of the kernel variants side by side, in one process (before/after record).

Variants: native instruction set (avx2 / avx512) x layer path (op-by-op Python / one native call
per layer) x activations (float32 / int8, the 8-bit activation kernels).  Round-robin over variants
and N, so drifts of a shared machine hit all alike.

    .venv/bin/python benchmarks/forward_variants.py --ns 1 2 4 6 8 16 64 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import kernels
from specdec.llm import LLM
from specdec.model.llama import SeqBatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["avx2:python:float32", "avx512:fused:float32", "avx512:fused:int8"],
        help="isa:layers:activations, layers python|fused, activations float32|int8",
    )
    args = ap.parse_args()
    ns = sorted(set(args.ns) | {1})
    llm = LLM(args.model, max_model_len=args.context + max(ns) + 1, max_num_seqs=1)
    model = llm.engine.model
    kv = model.make_kv_cache(1, args.context + max(ns) + 1)
    gen = torch.Generator().manual_seed(0)
    variants = [tuple(v.split(":")) for v in args.variants]
    times: dict[tuple, list[float]] = {(v, n): [] for v in variants for n in ns}
    with torch.inference_mode():
        prompt = torch.randint(0, model.cfg.vocab_size, (args.context,), generator=gen)
        model.forward(prompt, torch.arange(args.context), SeqBatch([0], [0], [args.context]), kv)
        inputs = {n: torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in ns}

        def step(n: int) -> float:
            start = time.perf_counter()
            pos = torch.arange(args.context, args.context + n)
            hidden = model.forward(inputs[n], pos, SeqBatch([0], [args.context], [n]), kv)
            float(model.compute_logits(hidden)[-1, 0])
            return time.perf_counter() - start

        for rep in range(args.repeats + 1):
            for isa, layers, act in variants:
                kernels.set_native_isa(isa)
                model.set_activation_dtype(act)
                model.use_fused_layers = layers == "fused"
                for n in ns:
                    t = step(n)
                    if rep:  # the first round is warm-up
                        times[((isa, layers, act), n)].append(t)
    kernels.set_native_isa("auto")
    print(f"{args.model}, context {args.context}, median of {args.repeats}, ms (ratio to N=1)")
    print("| kernels | layers | activations | " + " | ".join(f"N={n}" for n in ns) + " |")
    print("|---|---|---|" + "---|" * len(ns))
    for v in variants:
        med = {n: 1000 * statistics.median(times[(v, n)]) for n in ns}
        cells = [f"{med[n]:.1f} ({med[n] / med[1]:.2f})" for n in ns]
        layers = "one call" if v[1] == "fused" else "python ops"
        print(f"| {v[0]} | {layers} | {v[2]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
