"""Where a decoder layer's time goes at N rows a step (not a test): the native forward's timeline
(``_C.set_timeline``) over many steps of one sequence at a fixed context, per part of a layer:
each linear product with the rate its weights were read at, the attention, and the rest of the
layer (norms, rotary and KV writes, residual adds, the activation, and the calls between them),
then the output layer; beside them the machine's read bandwidth and what each part's bytes need
at it.

    .venv/bin/python benchmarks/layer_timeline.py --model smollm2-135m --context 200 --n 1
    .venv/bin/python benchmarks/layer_timeline.py --model qwen3-1.7b-Q4_0.gguf --n 8 --kv-cache-dtype int8

Medians over every layer but the last and every step. The marks cost a clock read each (~12 a
layer), so the step itself runs a little slower than unmarked.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdec import LLM
from specdec.bench.roof import read_bandwidth
from specdec.kernels.native import _C
from specdec.model.llama import SeqBatch

LAYER, LINEAR, LINEAR_END, ATTENTION, ATTENTION_END = range(5)
DENSE_NAMES = ("qkv", "o_proj", "gate_up", "down")


def parse(marks: list[float]) -> tuple[list[dict], list[tuple[float, float]]]:
    """The layers (each: its span to the next layer's start, its linears' (us, bytes) in order,
    its attention's us; ``last``: a forward's last layer) and the linears outside any layer (the
    output layer's), from flat (kind, us, bytes) triples."""
    layers: list[dict] = []
    outside: list[tuple[float, float]] = []
    cur: dict | None = None
    open_linear: tuple[float, float] | None = None
    attn_start = 0.0
    for i in range(0, len(marks) - 2, 3):
        kind, us, nbytes = int(marks[i]), marks[i + 1], marks[i + 2]
        if kind == LAYER:
            if cur is not None:
                cur["span"] = us - cur["start"]
                layers.append(cur)
            cur = {"start": us, "linears": [], "attention": 0.0, "span": None, "last": False}
        elif kind == LINEAR:
            open_linear = (us, nbytes)
        elif kind == LINEAR_END and open_linear is not None:
            part = (us - open_linear[0], open_linear[1])
            open_linear = None
            if cur is not None and len(cur["linears"]) < 4:
                cur["linears"].append(part)
            else:
                outside.append(part)
        elif kind == ATTENTION:
            attn_start = us
        elif kind == ATTENTION_END and cur is not None:
            cur["attention"] = us - attn_start
        if kind == LINEAR and cur is not None and len(cur["linears"]) == 4:
            # a fifth product after a dense layer's four: the output layer's (its span holds the
            # final norm and the return to Python too)
            cur["span"], cur["last"] = us - cur["start"], True
            layers.append(cur)
            cur = None
    return layers, outside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=200, help="cached positions before each step")
    ap.add_argument("--n", type=int, default=1, help="rows a step (1: decode; more: verification)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, help="kernel threads (default: torch's)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(
        args.model,
        max_model_len=args.context + args.n + 64,
        max_num_seqs=1,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    model = llm.engine.model
    if not getattr(model, "use_fused_layers", False):
        raise SystemExit("layer_timeline: the model does not run the native fused layers")
    kv = model.make_kv_cache(1, args.context + args.n + 64)
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    ctx, n = args.context, args.n
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (ctx,), generator=gen)
        model.forward(prompt, torch.arange(ctx), SeqBatch([0], [0], [ctx]), kv)
        ids = torch.randint(0, vocab, (n,), generator=gen)
        pos = torch.arange(ctx, ctx + n)
        batch = SeqBatch([0], [ctx], [n])

        def step() -> None:
            model.compute_logits(model.forward(ids, pos, batch, kv))

        for _ in range(10):
            step()
        _C.set_timeline(True)
        _C.timeline()
        try:
            for _ in range(args.steps):
                step()
        finally:
            _C.set_timeline(False)
        marks = _C.timeline()
    layers, outside = parse(marks)
    layers = [layer for layer in layers if len(layer["linears"]) == 4 and not layer["last"]]
    if not layers:
        raise SystemExit(
            "layer_timeline: no dense layer recorded (mixture-of-experts layers are not split)"
        )
    gbs = read_bandwidth(2)

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    rows = []
    for j, name in enumerate(DENSE_NAMES):
        us = med([layer["linears"][j][0] for layer in layers])
        nbytes = med([layer["linears"][j][1] for layer in layers])
        rows.append({"part": name, "us": us, "bytes": nbytes, "gb_s": nbytes / us / 1e3})
    attention = med([layer["attention"] for layer in layers])
    span = med([layer["span"] for layer in layers])
    rest = med(
        [
            layer["span"] - layer["attention"] - sum(t for t, _ in layer["linears"])
            for layer in layers
        ]
    )
    rows.append({"part": "attention", "us": attention, "bytes": 0.0, "gb_s": float("nan")})
    rows.append({"part": "rest of the layer", "us": rest, "bytes": 0.0, "gb_s": float("nan")})
    layer_bytes = sum(r["bytes"] for r in rows)
    out = {
        "model": args.model,
        "context": ctx,
        "n": n,
        "kv_cache_dtype": args.kv_cache_dtype,
        "threads": torch.get_num_threads(),
        "read_bandwidth_gb_s": gbs,
        "layer_us": span,
        "layer_weight_bytes": layer_bytes,
        "parts": rows,
    }
    print(
        f"{args.model}, {ctx} cached, {n} row(s) a step, KV {args.kv_cache_dtype}, "
        f"{torch.get_num_threads()} thread(s); "
        f"read bandwidth {gbs:.1f} GB/s (torch.sum, 2 threads)"
    )
    print(
        "| part | us (median) | share of the layer | weight MB | read at GB/s | us its bytes need |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        need = r["bytes"] / gbs / 1e3 if r["bytes"] else 0.0
        rate = f"{r['gb_s']:.1f}" if r["bytes"] else ""
        print(
            f"| {r['part']} | {r['us']:.1f} | {r['us'] / span:.0%} | {r['bytes'] / 1e6:.3f} | {rate} | "
            f"{need:.1f} |"
        )
    print(f"| layer | {span:.1f} | | {layer_bytes / 1e6:.3f} | {layer_bytes / span / 1e3:.1f} | "
          f"{layer_bytes / gbs / 1e3:.1f} |")  # fmt: skip
    if outside:
        us, nbytes = med([t for t, _ in outside]), med([b for _, b in outside])
        print(
            f"output layer: {us:.1f} us, {nbytes / 1e6:.1f} MB read at {nbytes / us / 1e3:.1f} GB/s"
        )
        out["output_layer"] = {"us": us, "bytes": nbytes, "gb_s": nbytes / us / 1e3}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
