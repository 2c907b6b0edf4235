"""Batch-1 greedy decode tok/s of smollm2-135m, plain and with n-gram drafting, on the code-edit
prompts of tests/fixtures/bench_prompts.jsonl (chat template, 128 tokens each).

For before/after comparisons of an engine change, alternate processes over two checkouts:

    for i in 1 2 3; do for repo in /tmp/base .; do
        .venv/bin/python benchmarks/speculator_ab.py --repo $repo; done; done

(/tmp/base: ``git worktree add /tmp/base <commit>`` with the built ``*.so`` files copied in.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "bench_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=".", help="checkout whose specdec to import")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=6)
    args = ap.parse_args()
    sys.path.insert(0, args.repo)
    import specdec
    from specdec import LLM, SamplingParams

    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line]
    prompts = [r["turns"][0] for r in rows if r["category"].startswith("code_edit")]
    prompts = prompts[: args.num_prompts]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    result = {"repo": args.repo, "specdec": str(Path(specdec.__file__).parent)}
    for name, spec in (("plain", None), ("ngram", {"method": "ngram"})):
        llm = LLM("smollm2-135m", max_num_seqs=1, speculative_config=spec)
        tok = llm.get_tokenizer()
        ids = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )
            for p in prompts
        ]
        llm.generate([ids[0][:16]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        num, elapsed = 0, 0.0
        for p in ids:
            start = time.perf_counter()
            out = llm.generate([p], sp)
            elapsed += time.perf_counter() - start
            num += len(out[0].outputs[0].token_ids)
        result[name] = round(num / elapsed, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
