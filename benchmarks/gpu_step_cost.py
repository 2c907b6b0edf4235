"""The cost of one decode / verification step by rows and context, at fixed shapes (CUDA graph,
and eager) and on the variable-shape torch path: what issue 36's "8 rows <= 1.15x one row" reads.

    python3 benchmarks/gpu_step_cost.py MODEL [--device cuda] [--contexts 200 2000] [--ns 1 8]
        [--json OUT.json]

Each figure is the median of ``--reps`` steps after warm-up, with the device synchronised
around each step. ``--device cpu`` (torch kernels) is a dry run of the script, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from specdec import LLM
from specdec.model.llama import SeqBatch
from specdec.worker.static_runner import StaticForward


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> list[dict]:
    llm = LLM(
        args.model, device=args.device, kernels="torch", static_shapes=True,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
    )  # fmt: skip
    static: StaticForward = llm.engine.runner.static
    model, kv = static.model, static.kv
    device = model.device
    vocab = model.cfg.vocab_size
    rows = []
    for context in args.contexts:
        ids = [(i * 7919 + 13) % vocab for i in range(context + max(args.ns))]
        static.prefill(0, 0, ids[:context])
        for n in args.ns:
            step = ids[context : context + n]
            one = [(0, context, step)]
            graph = _median_ms(lambda one=one: static.step(one), device, args.reps)
            static.use_graphs = False
            eager = _median_ms(lambda one=one: static.step(one), device, args.reps)
            static.use_graphs = device.type == "cuda"
            batch = SeqBatch([0], [context], [n])
            t_ids = torch.tensor(step, device=device)
            t_pos = torch.arange(context, context + n, device=device)

            def variable(t_ids=t_ids, t_pos=t_pos, batch=batch) -> None:
                hidden = model.forward(t_ids, t_pos, batch, kv)
                model.compute_logits(hidden)

            var = _median_ms(variable, device, args.reps)
            rows.append(
                {
                    "context": context,
                    "n": n,
                    "graph_ms": graph,
                    "eager_static_ms": eager,
                    "variable_torch_ms": var,
                }  # fmt: skip
            )
            print(
                f"context {context:5d}  rows {n:2d}  graph {graph:7.3f} ms  eager(static) "
                f"{eager:7.3f} ms  variable-shape torch {var:7.3f} ms",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 2000])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
