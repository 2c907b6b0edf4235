"""Where a plain decode step's time goes in the engine: the target forward (decoder layers), the
output layer (logits), and the rest of ``LLMEngine.step`` (scheduling, sampling, bookkeeping,
outputs), in ms a step, from wrapped calls over whole ``generate`` runs at batch 1.

    .venv/bin/python benchmarks/step_split.py --model smollm2-135m --max-tokens 300 --runs 3

The roof a step is held against (weights + KV bytes over the read bandwidth) is
``benchmarks/memory_roof.py``'s.
"""

from __future__ import annotations

import argparse
import json
import time

from specdec import LLM, SamplingParams

PROMPT = "Write a long story about a dragon and a knight."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(args.model, max_num_seqs=1)
    engine, model = llm.engine, llm.engine.model
    spent = {"forward": 0.0, "logits": 0.0, "step": 0.0}

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def call(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start

        setattr(obj, name, call)

    timed(model, "forward_capture", "forward")
    timed(model, "compute_logits", "logits")
    timed(engine, "step", "step")
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps = 0
    for key in spent:
        spent[key] = 0.0
    wall = time.perf_counter()
    for _ in range(args.runs):
        out = llm.generate([PROMPT], sp, use_tqdm=False)
        steps += len(out[0].outputs[0].token_ids)  # one token a step (plain decoding)
    wall = time.perf_counter() - wall
    per = {k: round(1000 * v / steps, 2) for k, v in spent.items()}
    per["rest_of_step"] = round(per["step"] - per["forward"] - per["logits"], 2)
    per["outside_step"] = round(1000 * wall / steps - per["step"], 2)
    print(json.dumps({"model": args.model, "steps": steps, "ms_per_step": per}))


if __name__ == "__main__":
    main()
