"""Where hybrid's time goes against suffix decoding alone: one process, configurations
interleaved per prompt, greedy, 256 tokens, caches reset before every prompt.

    python benchmarks/hybrid_probe.py --per-category 5 \
        --variants suffix hybrid always_on plain

Variants (all but ``plain`` and the ``suffix*`` ones are ``hybrid`` with k = 3 and the shipped
head):
  suffix         suffix decoding as shipped (k = 32, adaptive)
  suffix_gated   suffix decoding with its drafts gated by the request's running rates
                 (Proposer.confident_drafts off: before session 13)
  suffix_fixed   suffix decoding without the adaptive controller (``adaptive=false``)
  hybrid         as shipped: the head is judged after MIN_HEAD_TRIALS drafts
  hybrid_gated   hybrid with its drafts gated by the rates (confident_drafts off)
  always_on      the head is never judged (hybrid before session 12)
  nohead         the head never drafts and no state is kept, but the target still returns them
  nohead_states  the head never drafts; states are kept and read every STASH_ROWS positions
  nocapture      the head never drafts and the target returns no states
Prints seconds per category and configuration, and each configuration's ratio to the first.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdec.bench.configs import parse_config
from specdec.bench.dataset import PromptBuilder, load_items
from specdec.bench.runners import GenParams, SpecdecRunner
from specdec.config import EngineArgs

FILES = ("mt_bench.jsonl", "gsm8k_test.jsonl", "humaneval.jsonl", "stdlib_edit.jsonl")


def suffix_only(req, drafts, num_rows):
    return ("suffix", len(drafts)) if drafts else ("none", 0)


def make_runner(variant: str, engine: EngineArgs) -> SpecdecRunner:
    bases = {"plain": "plain", "suffix": "suffix", "suffix_gated": "suffix"}
    bases["suffix_fixed"] = "suffix:adaptive=false"
    runner = SpecdecRunner(parse_config(bases.get(variant, "hybrid:k=3")), engine)
    p = runner.llm.engine.speculator.proposer if runner.llm.engine.speculator else None
    if variant.endswith("_gated"):
        p.confident_drafts = False  # read by the engine every step
    elif variant == "always_on":
        p._head_pays = lambda: True
    elif variant in ("nohead", "nohead_states", "nocapture"):
        p._choose = suffix_only
        if variant != "nohead_states":
            p._unread = lambda req: (req.hidden_start, [], 0)
        if variant == "nocapture":
            runner.llm.engine.runner.hidden_layers = ()
    return runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/bench/data")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variants", nargs="+", default=["suffix", "hybrid", "always_on", "plain"])
    args = ap.parse_args()
    items = load_items([Path(args.data) / f for f in FILES], num_per_category=args.per_category)
    engine = EngineArgs(model=args.model)
    runners = {v: make_runner(v, engine) for v in args.variants}
    builder = PromptBuilder(runners[args.variants[0]].tokenizer, True)
    for r in runners.values():  # warm up
        r.generate(builder.prompt_ids(items[0], []), GenParams(max_tokens=32))
    params = GenParams(max_tokens=args.max_tokens)
    seconds: dict[str, dict[str, float]] = {}
    outputs: dict[str, set] = {}
    for it in items:
        ids = builder.prompt_ids(it, [])
        for v, r in runners.items():
            r.reset_caches()
            t = time.perf_counter()
            res = r.generate(ids, params)
            cat = seconds.setdefault(it.category, {})
            cat[v] = cat.get(v, 0.0) + time.perf_counter() - t
            outputs.setdefault(it.id, set()).add(tuple(res.output_token_ids))
    same = sum(len(s) == 1 for s in outputs.values())
    print(f"outputs identical across configurations: {same} / {len(outputs)}")
    for v, r in runners.items():
        p = r.llm.engine.speculator.proposer if r.llm.engine.speculator else None
        if p is not None and hasattr(p, "head_on"):
            print(f"{v}: head on {p.head_on}, drafts {p.num_drafted}, trials {p.trials}, "
                  f"hits {p.hits}, head step {p.head_step_ms:.3f} ms")  # fmt: skip
    first = args.variants[0]
    print(f"{'category':28s}" + "".join(f"{v:>14s}" for v in args.variants))
    total = {v: sum(c[v] for c in seconds.values()) for v in args.variants}
    for name, c in [*seconds.items(), ("overall", total)]:
        ratios = " ".join(f"{c[first] / c[v]:.3f}" for v in args.variants[1:])
        print(f"{name:28s}" + "".join(f"{c[v]:14.2f}" for v in args.variants) + f"   {ratios}")


if __name__ == "__main__":
    main()
