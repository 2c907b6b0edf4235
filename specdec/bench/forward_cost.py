"""``specdec bench forward-cost``: the price of verifying N tokens at once.

Times one target forward over N new tokens with ``context`` tokens already in the KV cache,
logits for all N rows included (as verification needs), for each N. The median over repeats is
reported in ms and as a ratio to N = 1: speculation pays when the accepted tokens per step exceed
that ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.bench.args import FORWARD_COST_ENGINE_ARGS, engine_settings
from specdec.config import EngineArgs

DEFAULT_NS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class ForwardCostOptions:
    engine: EngineArgs  # the engine options (FORWARD_COST_ENGINE_ARGS on the command line)
    context: int = 200
    ns: tuple[int, ...] = DEFAULT_NS
    repeats: int = 10
    warmup: int = 2
    seed: int = 0
    json_path: str | None = None
    moe_grouped: bool = True  # False: each row's experts one by one (mixture-of-experts models)


def measure_forward_cost(
    model, context: int, ns: list[int], repeats: int, warmup: int, seed: int = 0
) -> list[dict]:
    """Median ms of ``forward`` + ``compute_logits`` over N rows, per N (N = 1 always measured).

    Every repeat writes the same KV positions after the cached context, so the context stays fixed,
    with fresh random tokens: a mixture of experts routes them to other experts each time, as a
    real decode does (repeating one input would find its experts' weights still in the cache).
    The context's KV is measured as a sequence that has been running a while holds it: in huge
    pages where the pool backs a long sequence with them, which it does while the model is idle
    (kv_cache/memory.py), so the timed steps wait for that first.
    """
    from specdec.kv_cache.memory import settle_huge_pages
    from specdec.model.llama import SeqBatch

    ns = sorted(set(ns) | {1})
    max_len = context + max(ns) + 1
    if max_len > model.max_len:
        raise ValueError(
            f"context {context} + N {max(ns)} exceeds the model's max_len {model.max_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    kv = model.make_kv_cache(1, max_len)
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (context,), generator=gen)
        model.forward(prompt, torch.arange(context), SeqBatch([0], [0], [context]), kv)
        settle_huge_pages()
        runs = warmup + repeats
        inputs = {n: torch.randint(0, vocab, (runs, n), generator=gen) for n in ns}
        used = dict.fromkeys(ns, 0)

        def step(n: int) -> float:
            ids, used[n] = inputs[n][used[n]], used[n] + 1
            start = time.perf_counter()
            pos = torch.arange(context, context + n)
            hidden = model.forward(ids, pos, SeqBatch([0], [context], [n]), kv)
            logits = model.compute_logits(hidden)  # [n, vocab]
            float(logits[-1, 0])  # NOTE: the work is done before the clock stops
            return time.perf_counter() - start

        for n in ns:
            for _ in range(warmup):
                step(n)
        # NOTE: round-robin over N, so drifts of a shared machine hit every N alike.
        times: dict[int, list[float]] = {n: [] for n in ns}
        for _ in range(repeats):
            for n in ns:
                times[n].append(step(n))
    rows = [
        {"n": n, "ms": 1000.0 * statistics.median(t), "ms_all": [1000.0 * x for x in t]}
        for n, t in times.items()
    ]
    base = rows[0]["ms"]
    for r in rows:
        r["ratio"] = r["ms"] / base
        r["ms_per_token"] = r["ms"] / r["n"]
    return rows


def format_forward_cost(rows: list[dict], title: str) -> str:
    """A markdown table shaped like ANCHORS.md's (N across, ms and ratio down)."""
    ns = [str(r["n"]) for r in rows]
    lines = [
        f"| {title} | " + " | ".join(ns) + " |",
        "|---|" + "---|" * len(ns),
        "| ms | " + " | ".join(f"{r['ms']:.1f}" for r in rows) + " |",
        "| ratio to N=1 | " + " | ".join(f"{r['ratio']:.2f}" for r in rows) + " |",
        "| ms per token | " + " | ".join(f"{r['ms_per_token']:.1f}" for r in rows) + " |",
    ]
    return "\n".join(lines) + "\n"


def run_forward_cost(opts: ForwardCostOptions) -> dict[str, Any]:
    from specdec.bench import report
    from specdec.llm import LLM
    from specdec.model.registry import resolve_model_path

    max_len = max(16, opts.context + max(opts.ns) + 1)
    llm = LLM.from_engine_args(opts.engine.replace(max_model_len=max_len, max_num_seqs=1))
    model = llm.engine.model
    for lw in model.layers:
        if lw.moe is not None:
            lw.moe.grouped = opts.moe_grouped
    model._fused = None  # NOTE: native layers take the flag when they are built
    rows = measure_forward_cost(
        model, opts.context, list(opts.ns), opts.repeats, opts.warmup, opts.seed
    )
    title = (
        f"N (context {opts.context}, kernels {opts.engine.kernels}, quantization "
        f"{opts.engine.quantization}, "
        f"activations {model.activation_dtype}, KV cache {str(model.kv_dtype).removeprefix('torch.')}"
        f"{'' if opts.moe_grouped else ', experts one by one'})"
    )
    print(format_forward_cost(rows, title))
    settings = {k: v for k, v in asdict(opts).items() if k not in ("json_path", "engine")}
    settings.update(engine_settings(opts.engine, FORWARD_COST_ENGINE_ARGS))
    model_path = str(resolve_model_path(opts.engine.model))
    payload = {
        "schema": "specdec.bench.forward_cost/1",
        "environment": report.collect_environment(
            opts.engine.model, model_path, {"settings": settings}
        ),
        "rows": rows,
    }
    if opts.json_path:
        path = Path(opts.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        report.write_json(path, payload)
        print(f"wrote {path}")
    return payload
