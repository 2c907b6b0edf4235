"""Where a plain decode step's time goes in the engine: the target forward (decoder layers), the
output layer (logits), and the rest of ``LLMEngine.step`` (scheduling, sampling, bookkeeping,
outputs), in ms a step, from wrapped calls over whole ``generate`` runs at batch 1.

Beside those means, the median microseconds a step of each phase (``schedule``, the executor's
``execute``, ``update``, ``outputs``), of the two native calls of a forward (the layer stack,
``layers``, and the output layer, ``logits``) and of the step outside them
(``outside_native``: the Python and small torch calls between the kernels). The weights stream
through the caches every step, so on a real model each of those calls starts cold; ``--tiny``
(a 2-layer random model) shows the same code warm.

    .venv/bin/python benchmarks/step_split.py --model smollm2-135m --max-tokens 300 --runs 3
    PYTHONPATH=../older-checkout .venv/bin/python benchmarks/step_split.py ...  # before/after

Python's time moves with this machine's speed: alternate runs of two trees several times and
compare medians. The roof a step is held against (weights + KV bytes over the read bandwidth) is
``benchmarks/memory_roof.py``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specdec import LLM, SamplingParams

PROMPT = "Write a long story about a dragon and a knight."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random model instead")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    model_name = args.model
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests
        from tests.fixtures.models import make_tiny_model

        model_name = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama", seed=1))
    llm = LLM(model_name, max_num_seqs=1, max_model_len=max(512, args.max_tokens + 64))
    engine, model = llm.engine, llm.engine.model
    spent = {"forward": 0.0, "logits": 0.0, "step": 0.0}
    calls: dict[str, list[float]] = {}

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def call(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                took = time.perf_counter() - start
                calls.setdefault(key, []).append(took)
                if key in spent:
                    spent[key] += took

        setattr(obj, name, call)

    timed(model, "forward_capture", "forward")
    timed(model, "compute_logits", "logits")
    timed(engine, "step", "step")
    timed(model.ops, "forward_layers", "layers")
    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.executor, "execute_model", "execute")
    timed(engine.scheduler, "update_from_output", "update")
    timed(engine.output_processor, "process_outputs", "outputs")
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] if args.tiny else PROMPT
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps = 0
    for key in spent:
        spent[key] = 0.0
    calls.clear()
    wall = time.perf_counter()
    for _ in range(args.runs):
        out = llm.generate([prompt], sp, use_tqdm=False)
        steps += len(out[0].outputs[0].token_ids)  # one token a step (plain decoding)
    wall = time.perf_counter() - wall
    per = {k: round(1000 * v / steps, 2) for k, v in spent.items()}
    per["rest_of_step"] = round(per["step"] - per["forward"] - per["logits"], 2)
    per["outside_step"] = round(1000 * wall / steps - per["step"], 2)
    # medians of the decode steps (each run's prompt step and first few left out)
    keep = {k: v for k, v in calls.items() if k in ("layers", "logits") or len(v) >= steps}
    us = {k: 1e6 * statistics.median(v[20:] or v) for k, v in keep.items()}
    us["outside_native"] = us["step"] - us["layers"] - us["logits"]
    us["execute_outside_native"] = us["execute"] - us["layers"] - us["logits"]
    us = {k: round(v, 1) for k, v in us.items()}
    name = "tiny" if args.tiny else args.model
    print(json.dumps({"model": name, "steps": steps, "ms_per_step": per, "us_median": us}))


if __name__ == "__main__":
    main()
