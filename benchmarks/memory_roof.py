"""The memory roof of one decode step: (weight bytes + KV bytes at context C) / read bandwidth.

A decode step (N = 1) reads every weight once and the whole KV cache once; nothing can make it
faster than those bytes over the machine's read bandwidth. This script measures the bandwidth
(``torch.sum`` over a 2 GiB float32 tensor with the benchmark's thread count, best of five),
counts the model's weight bytes as loaded (every tensor the model holds, once; the token
embedding counts whole, as a tied LM head reads it whole) and its KV bytes per token (layers x
2 x KV heads x head size x element size; sliding windows ignored), and prints the roof per
context. With ``--forward-cost`` JSON files (``specdec bench forward-cost --json``) it adds the
measured N = 1 time and its ratio to the roof (issue 37's goal: <= 1.15).

    .venv/bin/python benchmarks/memory_roof.py --model smollm2-135m --threads 2 \\
        --contexts 200,2000,3800 --forward-cost fc_200.json fc_2000.json fc_3800.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields, is_dataclass

import torch

from specdec.bench.roof import read_bandwidth


@dataclass
class Roof:
    context: int
    weight_mb: float
    kv_mb: float
    bandwidth_gbs: float

    @property
    def roof_ms(self) -> float:
        return (self.weight_mb + self.kv_mb) / self.bandwidth_gbs  # MB / (GB/s) = ms


def _tensors(obj, seen: set[int], out: dict[int, int], depth: int = 0) -> None:
    """Every torch tensor reachable from obj's attributes, lists, tuples and dicts, by storage."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple):
        items = list(obj)
    elif is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name, None) for f in fields(obj)]
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("specdec"):
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        _tensors(item, seen, out, depth + 1)


def model_bytes(
    model_name: str, quantization: str, max_len: int, kv_cache_dtype: str = "auto"
) -> tuple[float, float]:
    """(weight MB, KV MB per token) of the model as the engine loads it."""
    from specdec.kv_cache.pool import KVCache
    from specdec.llm import LLM

    llm = LLM(
        model_name, quantization=quantization, max_model_len=max_len, max_num_seqs=1,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    model = llm.engine.model
    storages: dict[int, int] = {}
    _tensors(model, set(), storages)
    cfg = model.cfg
    kv_token = KVCache.bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.kv_dtype
    )  # an int8 cache's scales included
    return sum(storages.values()) / 1e6, kv_token / 1e6


def _measured_n1(paths: list[str]) -> dict[int, float]:
    """context -> N = 1 ms from forward-cost JSON files."""
    out: dict[int, float] = {}
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        context = payload["environment"]["settings"]["context"]
        out[int(context)] = next(r["ms"] for r in payload["rows"] if r["n"] == 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", "-q", default="auto", help="as forward-cost's --quantization")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as forward-cost's --kv-cache-dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="200,2000,3800")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="size of the sum's tensor")
    ap.add_argument("--forward-cost", nargs="*", default=[], help="forward-cost --json files")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    weight_mb, kv_token_mb = model_bytes(
        args.model, args.quantization, max(contexts) + 32, args.kv_cache_dtype
    )
    bw = read_bandwidth(args.threads, args.bandwidth_gib)
    measured = _measured_n1(args.forward_cost)
    print(
        f"model {args.model}: weights {weight_mb:.1f} MB, KV ({args.kv_cache_dtype}) "
        f"{kv_token_mb * 1e3:.1f} KB a token"
    )
    print(f"read bandwidth ({args.threads} threads, torch.sum): {bw:.1f} GB/s\n")
    print("| context | weights MB | KV MB | roof ms | N=1 ms | N=1 / roof |")
    print("|---|---|---|---|---|---|")
    for c in contexts:
        roof = Roof(c, weight_mb, c * kv_token_mb, bw)
        got = measured.get(c)
        extra = f"{got:.2f} | {got / roof.roof_ms:.2f}" if got else "- | -"
        print(f"| {c} | {weight_mb:.1f} | {roof.kv_mb:.1f} | {roof.roof_ms:.2f} | {extra} |")


if __name__ == "__main__":
    main()
