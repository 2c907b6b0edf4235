"""One decode step over a KV cache in huge pages against the same cache in 4 KiB pages (not a test).

Two one-slot caches of the same model in one process, each filled with the same ``--context``
positions: one as a long sequence's slot is (``KVCache.grow`` advises it to transparent huge pages
before the prompt is written), one kept on base pages. Steps of ``--n`` rows are then timed on
each in turn, the order alternating round by round; prints each round's median step (ms), the
medians over the rounds and the huge pages the process holds.

    .venv/bin/python benchmarks/kv_huge_pages.py --context 2000 --n 1
    .venv/bin/python benchmarks/kv_huge_pages.py --context 3800 --n 1 --kv-cache-dtype int8
    .venv/bin/python benchmarks/kv_huge_pages.py --model qwen3-1.7b-Q4_K_M.gguf --context 2000
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

from specdec import LLM  # NOTE: specdec before torch (OpenMP spin-wait)


def huge_mib() -> int:
    with open("/proc/self/smaps") as f:
        return sum(int(x) for x in re.findall(r"AnonHugePages:\s+(\d+)", f.read())) >> 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--n", type=int, default=1, help="rows a step")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=1.5, help="of steps per round and cache")
    args = ap.parse_args()
    import torch

    from specdec.kv_cache.memory import settle_huge_pages
    from specdec.model.llama import SeqBatch

    ctx, n = args.context, args.n
    llm = LLM(
        args.model, max_model_len=ctx + n + 16, max_num_seqs=1, kv_cache_dtype=args.kv_cache_dtype
    )
    model = llm.engine.model
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (ctx,), generator=gen)
    caches = {}
    for name in ("base pages", "huge pages"):
        kv = model.make_kv_cache(1, ctx + n + 8)
        kv.huge_pages = name == "huge pages"
        model.forward(prompt, torch.arange(ctx), SeqBatch([0], [0], [ctx]), kv)
        caches[name] = kv
        settle_huge_pages()  # collapsed while the model is idle (kv_cache/memory.py)
        print(json.dumps({"cache": name, "process_huge_pages_mib": huge_mib()}))
    pos = torch.arange(ctx, ctx + n)
    medians: dict[str, list[float]] = {name: [] for name in caches}
    for r in range(args.rounds):
        order = list(caches) if r % 2 == 0 else list(reversed(caches))
        for name in order:
            kv, times = caches[name], []
            end = time.perf_counter() + args.seconds
            while time.perf_counter() < end:
                ids = torch.randint(0, vocab, (n,), generator=gen)
                t0 = time.perf_counter()
                logits = model.compute_logits(
                    model.forward(ids, pos, SeqBatch([0], [ctx], [n]), kv)
                )
                float(logits[-1, 0])  # NOTE: the work is done before the clock stops
                times.append(time.perf_counter() - t0)
            medians[name].append(1e3 * statistics.median(times))
    base, huge = (statistics.median(medians[k]) for k in caches)
    print(json.dumps({
        "context": ctx, "n": n, "kv_cache_dtype": args.kv_cache_dtype,
        "rounds_ms": {k: [round(x, 2) for x in v] for k, v in medians.items()},
        "median_ms": {"base pages": round(base, 2), "huge pages": round(huge, 2)},
        "speedup": round(base / huge, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
