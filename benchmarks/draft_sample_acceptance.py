"""Acceptance of draft_sample_method greedy vs probabilistic on draft_model and layer_skip.

12 writing and code-completion prompts of tests/fixtures/bench_prompts.jsonl (copied from the
shared bench data; nothing is trained here), 96 tokens, top-p 0.95, k=3, adaptive off:

    .venv/bin/python benchmarks/draft_sample_acceptance.py
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec import LLM, SamplingParams

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "bench_prompts.jsonl"
DRAFTERS = {
    "layer_skip": {},
    # the default model requantized to Q4_0 as its own draft: close to the target, not equal
    "draft_model": {"model": "smollm2-135m", "draft_quantization": "q4_0"},
}


def main() -> None:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line]
    items = [r for r in rows if not r["category"].startswith("code_edit")][:12]
    tok = LLM("smollm2-135m", max_model_len=1024).get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=True)[-300:]
        for r in items
    ]
    for method, extra in DRAFTERS.items():
        for temperature in (0.7, 1.0):
            cells = []
            for how in ("greedy", "probabilistic"):
                spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
                spec |= {"draft_sample_method": how, **extra}
                llm = LLM(
                    "smollm2-135m", speculative_config=spec, max_model_len=1024, max_num_seqs=12
                )
                params = [
                    SamplingParams(temperature=temperature, top_p=0.95, seed=i, max_tokens=96)
                    for i in range(len(prompts))
                ]
                llm.generate(prompts, params)
                st = llm.spec_decode_stats
                cells.append(
                    f"{how}: rate {st.acceptance_rate:.3f}, mean length {st.mean_acceptance_length:.2f}"
                )
            print(f"{method} T={temperature}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
