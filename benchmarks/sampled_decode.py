"""Batch-1 decode tok/s of smollm2-135m, sampled (temperature 0.7, top-p 0.9, seeded) and greedy.

For before/after comparisons, point it at two checkouts and alternate processes:

    for i in 1 2 3; do for repo in /tmp/base .; do
        .venv/bin/python benchmarks/sampled_decode.py --repo $repo; done; done

(/tmp/base: ``git worktree add /tmp/base <commit>`` with the built ``*.so`` files copied in.)
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=".", help="checkout whose specdec to import")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    sys.path.insert(0, args.repo)
    import specdec
    from specdec import LLM, SamplingParams

    llm = LLM("smollm2-135m", max_num_seqs=1)
    prompts = [
        "Write a short story about a robot who learns to paint.",
        "Explain how photosynthesis works in simple terms.",
        "List some tips for staying productive while working from home.",
    ]

    def tok_s(**kw) -> float:
        llm.generate(prompts[:1], SamplingParams(**{**kw, "max_tokens": 16}))  # warm-up
        num = 0
        start = time.perf_counter()
        for p in prompts:
            out = llm.generate([p], SamplingParams(**kw))
            num += len(out[0].outputs[0].token_ids)
        return num / (time.perf_counter() - start)

    n = args.max_tokens
    sampled = tok_s(temperature=0.7, top_p=0.9, seed=1, max_tokens=n, ignore_eos=True)
    greedy = tok_s(temperature=0.0, max_tokens=n, ignore_eos=True)
    print(f"{specdec.__file__}: sampled {sampled:.1f} tok/s, greedy {greedy:.1f} tok/s")


if __name__ == "__main__":
    main()
