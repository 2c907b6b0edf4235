"""Where the rows of a verification step go, and how many are thrown away (not a test).

Four measurements on the loaded model, each in this process:

- ``split``: one forward over N new tokens after ``--context`` cached ones, the decoder layers and
  the output layer (logits) timed apart, min and median of ``--repeats``;
- ``linear``: the 8-bit-activation linear kernels of every layer (qkv, o, gate/up, down) and
  of the output layer over M rows: microseconds a call (min over 30 passes through all layers)
  and multiply-adds per second, to set beside ``benchmarks/avx2_roof.py``'s int8 roof;
- ``attention``: the native attention kernel alone at the model's shape (its heads, kv heads and
  head size, float16 cache): N rows after ``--context`` cached positions, microseconds per layer
  (min over ``--repeats``) and the multiply-adds per second of its scores and values, to set
  beside ``benchmarks/avx2_roof.py``'s fp32 roof, and the rate it reads K and V at; with
  ``--cold`` a cache per layer, called in turn, so that each call reads its cache from memory;
- ``waste``: greedy speculative decoding of a chat-prompt set one prompt at a time: draft rows
  verified, accepted, and the rows past each verification's first rejected draft (their logits
  are computed and never read).

    .venv/bin/python benchmarks/verify_rows.py split --context 200 2000 --ns 1 8 16
    .venv/bin/python benchmarks/verify_rows.py linear --threads 1 2
    .venv/bin/python benchmarks/verify_rows.py attention --context 2000 --ns 1 8 16 --threads 1 2
    .venv/bin/python benchmarks/verify_rows.py attention --cold --context 2000 --ns 1 --threads 2
    .venv/bin/python benchmarks/verify_rows.py waste --dataset chat.jsonl --method suffix
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec import LLM, SamplingParams  # NOTE: specdec before torch (OpenMP spin-wait)


def split(model_name: str, contexts: list[int], ns: list[int], repeats: int) -> None:
    import torch

    from specdec.model.llama import SeqBatch

    longest = max(contexts) + max(ns) + 1
    llm = LLM(model_name, max_model_len=longest, max_num_seqs=1)
    model = llm.engine.model
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    for ctx in contexts:
        kv = model.make_kv_cache(1, ctx + max(ns) + 1)
        with torch.inference_mode():
            prompt = torch.randint(0, vocab, (ctx,), generator=gen)
            model.forward(prompt, torch.arange(ctx), SeqBatch([0], [0], [ctx]), kv)
            for n in ns:
                layers, logits = [], []
                for _ in range(repeats):
                    ids = torch.randint(0, vocab, (n,), generator=gen)
                    t0 = time.perf_counter()
                    h = model.forward(
                        ids, torch.arange(ctx, ctx + n), SeqBatch([0], [ctx], [n]), kv
                    )
                    t1 = time.perf_counter()
                    float(model.compute_logits(h)[-1, 0])
                    t2 = time.perf_counter()
                    layers.append(1e3 * (t1 - t0))
                    logits.append(1e3 * (t2 - t1))
                print(json.dumps({
                    "context": ctx, "n": n,
                    "layers_ms": {"min": min(layers), "median": statistics.median(layers)},
                    "logits_ms": {"min": min(logits), "median": statistics.median(logits)},
                }))  # fmt: skip


def linear(model_name: str, threads: list[int], ms: list[int]) -> None:
    import torch

    llm = LLM(model_name, max_model_len=64, max_num_seqs=1)
    model = llm.engine.model
    for t in threads:
        torch.set_num_threads(t)
        for name in ("qkv", "o_proj", "gate_up", "down", "lm_head"):
            # the output layer too: a Q8_0 one was half of a MoE file's 4-row step (session 26)
            lins = (
                [model.lm_head] if name == "lm_head" else [getattr(lw, name) for lw in model.layers]
            )
            n, k = lins[0].weight.out_features, lins[0].weight.in_features
            for m in ms:
                x = torch.randn(m, k)
                for lin in lins:
                    lin(x)
                best = float("inf")
                for _ in range(30):
                    t0 = time.perf_counter()
                    for lin in lins:
                        lin(x)
                    best = min(best, (time.perf_counter() - t0) / len(lins))
                print(json.dumps({
                    "threads": t, "linear": name, "N": n, "K": k, "M": m,
                    "qtype": lins[0].weight.qtype, "us": 1e6 * best, "gmac_s": m * n * k / best / 1e9,
                }))  # fmt: skip


def attention(
    model_name: str,
    contexts: list[int],
    ns: list[int],
    threads: list[int],
    repeats: int,
    cold: bool = False,
    kv_cache_dtype: str = "float16",
) -> None:
    import torch

    from specdec.kernels import _C
    from specdec.kv_cache.pool import KVCache, blocked_keys

    llm = LLM(model_name, max_model_len=64, max_num_seqs=1)
    cfg = llm.engine.model.cfg
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    # --cold: a cache per layer, called in turn, so that (as in a forward) each call finds its
    # keys and values in memory, not in the cache hierarchy the previous call left them in
    num_caches = cfg.num_layers if cold else 1
    for ctx in contexts:
        length = ctx + max(ns)
        if kv_cache_dtype == "int8":
            kv = KVCache(
                num_caches, 1, hkv, length, d, torch.int8, torch.device("cpu"), key_block=16
            )
            for layer in range(num_caches):
                kv.store(layer, 0, 0, *torch.randn(2, length, hkv, d, generator=gen))
            caches = [(kv.k[layer, 0], kv.v[layer, 0]) for layer in range(num_caches)]
        else:
            caches = [
                (
                    blocked_keys(torch.randn(hkv, length, d, generator=gen).half(), 16),
                    torch.randn(hkv, length, d, generator=gen).half(),
                )
                for _ in range(num_caches)
            ]
        elt = 1 if kv_cache_dtype == "int8" else 2
        for t in threads:
            torch.set_num_threads(t)
            for n in ns:
                q = torch.randn(n, h, d, generator=gen)
                for k, v in caches:
                    _C.attention(q, k, v, ctx, d**-0.5, 0, 0.0)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for k, v in caches:
                        _C.attention(q, k, v, ctx, d**-0.5, 0, 0.0)
                    best = min(best, (time.perf_counter() - t0) / num_caches)
                macs = 2 * h * d * sum(ctx + i + 1 for i in range(n))  # scores and values
                print(json.dumps({
                    "context": ctx, "n": n, "threads": t, "heads": [h, hkv, d], "cold": cold,
                    "us_per_layer": round(1e6 * best, 1),
                    "ms_all_layers": round(1e3 * best * cfg.num_layers, 2),
                    "gmac_s": round(macs / best / 1e9, 1),
                    "kv_gb_s": round(2 * hkv * ctx * d * elt / best / 1e9, 1),
                    "kv_cache_dtype": kv_cache_dtype,
                }))  # fmt: skip


def waste(model_name: str, dataset: Path, method: str, limit: int, max_tokens: int) -> None:
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    chats = [[{"role": "user", "content": r["turns"][0]}] for r in rows][:limit]
    longest = 4096
    llm = LLM(model_name, max_model_len=longest, speculative_config={"method": method})
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for chat in chats:
        llm.chat([chat], sp, use_tqdm=False)
    st = llm.spec_decode_stats
    wasted = st.num_draft_tokens - st.num_accepted_tokens
    print(json.dumps({
        "method": method, "prompts": len(chats), "verifications": st.num_drafts,
        "draft_rows": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
        "rows_past_first_rejection": wasted,
        "per_verification": wasted / max(1, st.num_drafts),
    }))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["split", "linear", "attention", "waste"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, nargs="+", default=[200, 2000])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--cold", action="store_true", help="attention: a cache per layer, in turn")
    ap.add_argument("--kv-cache-dtype", choices=["float16", "int8"], default="float16")
    ap.add_argument("--dataset", type=Path)
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.what == "split":
        split(args.model, args.context, args.ns, args.repeats)
    elif args.what == "linear":
        linear(args.model, args.threads, args.ms)
    elif args.what == "attention":
        attention(
            args.model,
            args.context,
            args.ns,
            args.threads,
            args.repeats,
            args.cold,
            args.kv_cache_dtype,
        )
    else:
        if args.dataset is None:
            ap.error("waste needs --dataset (jsonl with turns[0] per line)")
        waste(args.model, args.dataset, args.method, args.limit, args.max_tokens)


if __name__ == "__main__":
    main()
