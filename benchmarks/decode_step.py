"""Median ms per plain decode step on the default prompt (128 tokens, 3 runs): python benchmarks/decode_step.py"""

import statistics
import time

from specdec import LLM, SamplingParams
from specdec.cli import DEFAULT_PROMPT

llm = LLM("smollm2-135m")
ids = llm.get_tokenizer().apply_chat_template(
    [{"role": "user", "content": DEFAULT_PROMPT}], tokenize=True
)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))
res = []
for _ in range(3):
    e = llm.engine
    e.add_request(ids, sp)
    e.step()  # prefill
    t = time.perf_counter()
    n = 0
    while e.has_unfinished_requests():
        e.step()
        n += 1
    res.append(1000 * (time.perf_counter() - t) / n)
print(
    "plain decode ms/step:", [round(r, 2) for r in res], "median", round(statistics.median(res), 2)
)
