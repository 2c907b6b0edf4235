"""Requests on one long document (a shared system prompt, retrieval over one text, several
questions about one file): its KV held once and read once a step for all of them (shared
prefixes, kv_cache/pool.py) against each request holding and reading its own copy (what the
prefix cache did before: ``share_block = 0``). One engine, the two alternated round by round;
every output is checked token for token between them.

Two cases per round:
  - cached: the document's KV is already in the prefix cache (an earlier request), then a batch
    of requests arrives, each the document plus its own question;
  - cold: the prefix cache is emptied first; the first request computes the document and the
    others share what it has computed (running requests' prompts are shared too).

    .venv/bin/python benchmarks/shared_prefix.py --doc README.md --doc-tokens 2000 --batch 8

Prints one JSON line per (case, sharing): wall seconds of the batch's ``generate`` per round and
decode tokens/s, then the median ratio of the rounds (shared against copied).

--step times one decode step instead (the model's forward and logits, no engine): B sequences
of one row each after ``--doc-tokens`` cached positions, reading the whole blocks of the
document from one slot (shared) or each from its own copy; and, for scale, one sequence of one
row and one of B rows (a verification step) at the same depth. The four are alternated, best of
the repeats' medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

QUESTIONS = [
    "Summarise the text above in three sentences.",
    "Which commands does the text above show? List them.",
    "What is the main purpose of the project described above?",
    "Name two limitations the text above mentions.",
    "Write a short title for the text above.",
    "Which file formats does the text above mention?",
    "Explain the first section of the text above to a newcomer.",
    "What would you ask the authors of the text above?",
    "List three numbers that appear in the text above and what they measure.",
    "Rewrite the opening paragraph of the text above more briefly.",
    "Which options does the text above describe for speed?",
    "What does the text above say about testing?",
    "Translate the first sentence of the text above into French.",
    "Give one example from the text above of a command and its effect.",
    "What hardware does the text above talk about?",
    "Which section of the text above is the longest, and what is it about?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--doc", type=Path, default=Path("README.md"), help="the shared document")
    ap.add_argument("--doc-tokens", type=int, default=2000, help="its first N tokens")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--cases", nargs="+", default=["cached", "cold"], choices=["cached", "cold"])
    ap.add_argument("--speculative-config", type=json.loads, default=None, help="JSON, as vLLM's")
    ap.add_argument("--step", action="store_true", help="time one decode step (see above)")
    ap.add_argument("--repeats", type=int, default=12, help="--step: steps per round")
    args = ap.parse_args()
    if args.step:
        return step_cost(args)

    from specdec import LLM, SamplingParams

    if args.batch > len(QUESTIONS):
        raise SystemExit(f"--batch {args.batch}: at most {len(QUESTIONS)} questions")
    llm = LLM(
        args.model,
        max_num_seqs=args.batch,
        max_model_len=args.doc_tokens + 256,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
    )
    kv = llm.engine.kv
    share_block = kv.share_block
    if not share_block:
        raise SystemExit("shared prefixes need the native fused layers (--kernels native)")
    tok = llm.get_tokenizer()
    doc = tok.encode(args.doc.read_text())[: args.doc_tokens]
    prompts = [doc + tok.encode("\n\n" + q) for q in QUESTIONS[: args.batch]]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], warm, use_tqdm=False)

    def run(case: str, shared: bool) -> tuple[float, float, list[list[int]]]:
        kv.share_block = share_block if shared else 0
        llm.engine.reset_prefix_cache()
        if case == "cached":  # the document alone first: the prefix cache holds it
            llm.generate([{"prompt_token_ids": doc + [doc[0]]}], warm, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        decode = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs) / len(
            outs
        )  # a request's decode span
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return wall, (args.max_tokens - 1) / decode if decode > 0 else 0.0, tokens

    results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for case in args.cases:
            order = (True, False) if r % 2 == 0 else (False, True)
            outs = {}
            for shared in order:
                wall, tps, outs[shared] = run(case, shared)
                results.setdefault((case, shared), []).append((wall, tps))
            if outs[True] != outs[False]:
                raise SystemExit(f"round {r}, {case}: shared and copied outputs differ")
    kv.share_block = share_block
    for case in args.cases:
        for shared in (True, False):
            rows = results[case, shared]
            print(json.dumps({
                "case": case, "shared": shared, "batch": args.batch,
                "doc_tokens": len(doc), "kv_cache_dtype": args.kv_cache_dtype,
                "wall_s": [round(w, 3) for w, _ in rows],
                "decode_tok_s_per_request": [round(t, 2) for _, t in rows],
            }))  # fmt: skip
        ratio = [c[0] / s[0] for s, c in zip(results[case, True], results[case, False])]
        speed = [s[1] / c[1] for s, c in zip(results[case, True], results[case, False])]
        print(json.dumps({
            "case": case, "wall_copied_over_shared": round(statistics.median(ratio), 3),
            "decode_shared_over_copied": round(statistics.median(speed), 3),
        }))  # fmt: skip


def step_cost(args: argparse.Namespace) -> None:
    import torch

    from specdec.engine.loading import load_model
    from specdec.model.llama import SeqBatch

    c, b = args.doc_tokens, args.batch
    model, _ = load_model(
        args.model, torch.device("cpu"), torch.float32, "auto", "auto", c + b + 1,
        "auto", args.kv_cache_dtype,
    )  # fmt: skip
    block = model.ops.attn_block
    if not block or not model.use_fused_layers:
        raise SystemExit("shared prefixes need the native fused layers")
    kv = model.make_kv_cache(b, c + b + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    with torch.inference_mode():
        doc = torch.randint(0, vocab, (c,), generator=gen)
        model.forward(doc, torch.arange(c), SeqBatch([0], [0], [c]), kv)
        for s in range(1, b):
            kv.copy_prefix(0, s, c)
    shared = c // block * block
    cases = {
        "one_row": SeqBatch([0], [c], [1]),
        f"one_seq_{b}_rows": SeqBatch([0], [c], [b]),
        f"{b}_seqs_copied": SeqBatch(list(range(b)), [c] * b, [1] * b),
        f"{b}_seqs_shared": SeqBatch(list(range(b)), [c] * b, [1] * b, [0] * b, [0] + [shared] * (b - 1)),
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for _ in range(args.rounds * args.repeats):
            for name, batch in cases.items():
                n = sum(batch.num_tokens)
                ids = torch.randint(0, vocab, (n,), generator=gen)
                pos = torch.tensor(
                    [p + i for p, m in zip(batch.start_pos, batch.num_tokens) for i in range(m)]
                )
                t0 = time.perf_counter()
                model.compute_logits(model.forward(ids, pos, batch, kv))
                times[name].append(1000 * (time.perf_counter() - t0))
    per_round = {
        k: [statistics.median(v[i * args.repeats : (i + 1) * args.repeats]) for i in range(args.rounds)]
        for k, v in times.items()
    }  # fmt: skip
    print(json.dumps({
        "model": args.model, "context": c, "batch": b, "kv_cache_dtype": args.kv_cache_dtype,
        "shared_positions": shared, "ms_per_round": {k: [round(x, 2) for x in v] for k, v in per_round.items()},
        "copied_over_shared": round(min(per_round[f"{b}_seqs_copied"]) / min(per_round[f"{b}_seqs_shared"]), 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
