"""Our float32 next-token logits against transformers (float32 and float64) on the TP agreement
prompts of tp_bench.py: the rounding our kernels carry on their own, to set TP 2 vs TP 1 against.

    .venv/bin/python benchmarks/logit_noise.py
"""

import sys

import torch
import transformers

from specdec import LLM
from specdec.model.registry import resolve_model_path

sys.path.insert(0, "benchmarks")
from tp_bench import PROMPTS, _first_logits

prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(30)]
path = resolve_model_path("smollm2-135m")
hf = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32
).eval()
llm = LLM("smollm2-135m", max_model_len=512, activation_dtype="float32")
ours = _first_logits(llm, prompts)
tok = llm.get_tokenizer()
d32 = d64 = 0.0
hf64 = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float64
).eval()
for p, o in zip(prompts, ours):
    ids = torch.tensor([tok.encode(p)])
    with torch.no_grad():
        r32 = hf(ids).logits[0, -1].float()
        r64 = hf64(ids).logits[0, -1]
    d32 = max(d32, (o - r32).abs().max().item())
    d64 = max(d64, (r32.double() - r64).abs().max().item())
print(
    f"ours(float32, TP1) vs transformers float32: {d32:.2e}; transformers float32 vs float64: {d64:.2e}"
)
