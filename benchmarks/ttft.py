"""Time to first token for one long prompt (issue 37: a 3,000-token prompt against llama.cpp).

    .venv/bin/python benchmarks/ttft.py --model smollm2-135m --tokens 3000 --repeats 3

The prompt is this repository's own prose (README.md, repeated as needed), cut to ``--tokens``
tokens; each repeat changes its first word so that no prefix is reused. TTFT is the wall time of
``generate(max_tokens=1)``: tokenization, the chunked prefill and the first sample. llama.cpp's
figure for the same file: ``llama-bench -m FILE -p 3000 -n 0 -t 2 -fa 1`` (3,000 / its pp t/s).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specdec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--activation-dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = ap.parse_args()
    extra = {}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(args.model, max_model_len=args.tokens + 64, enable_prefix_caching=False,
              activation_dtype=args.activation_dtype, kv_cache_dtype=args.kv_cache_dtype,
              **extra)  # fmt: skip
    tok = llm.get_tokenizer()
    ids = tok.encode((ROOT / "README.md").read_text())
    while len(ids) < args.tokens:
        ids = ids + ids
    sp = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for r in range(args.repeats + 1):  # NOTE: the first run warms up (not counted)
        prompt = {"prompt_token_ids": [ids[r]] + ids[1 : args.tokens]}
        start = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        times.append(time.perf_counter() - start)
    ttft = statistics.median(times[1:])
    print(f"{args.model} ({args.activation_dtype}, KV {args.kv_cache_dtype}): TTFT for {args.tokens} prompt tokens: "
          f"median {ttft:.2f} s ({args.tokens / ttft:.0f} tok/s) over {args.repeats} runs "
          f"{[round(t, 2) for t in times[1:]]}")  # fmt: skip


if __name__ == "__main__":
    main()
