"""Plain decode of SmolLM2-135M (default prompt, 256 tokens, greedy): the fused layers called one
by one from Python (before session 13) against ``forward_layers``, the whole stack in one native
call (after). Two engines in one process, alternating order each round; ms per decode step.

    python benchmarks/layer_loop_ab.py
"""

import statistics
import time
import types

import torch

from specdec import LLM, SamplingParams
from specdec.cli import DEFAULT_PROMPT
from specdec.model import llama as L


def old_forward_capture(self, input_ids, positions, batch, kv, capture=(), num_layers=None):
    x = self.embed(input_ids)
    positions = positions.to(self.device)
    layers = self.layers[: num_layers or len(self.layers)]
    taken = {}
    fused = self._fused_layers()
    rows = {theta: (rot.cos[positions], rot.sin[positions]) for theta, rot in self._rotary.items()}
    for i in range(len(layers)):
        if i in capture:
            taken[i] = x
        cos, sin = rows[self.cfg.layer_rope_theta(i)]
        x = fused[i].forward(
            x, cos, sin, kv.k[i], kv.v[i], batch.slots, batch.start_pos, batch.num_tokens
        )
    taken[len(layers)] = x
    final = self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps)
    if not capture:
        return final, None
    taken[L.HIDDEN_FINAL] = final
    return final, torch.cat([taken[i] for i in capture], dim=-1)


llms = {"before": LLM("smollm2-135m"), "after": LLM("smollm2-135m")}
m = llms["before"].engine.model
m.forward_capture = types.MethodType(old_forward_capture, m)
ids = (
    llms["after"]
    .get_tokenizer()
    .apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}], tokenize=True)
)
sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
res = {k: [] for k in llms}
for llm in llms.values():
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=16))
for r in range(8):
    for k, llm in llms.items() if r % 2 == 0 else reversed(list(llms.items())):
        e = llm.engine
        e.add_request(ids, sp)
        e.step()
        t = time.perf_counter()
        n = 0
        while e.has_unfinished_requests():
            e.step()
            n += 1
        res[k].append(1000 * (time.perf_counter() - t) / n)
for k, v in res.items():
    print(k, "ms/step", [round(x, 3) for x in v], "median", round(statistics.median(v), 3))
print("after/before", round(statistics.median(res["after"]) / statistics.median(res["before"]), 4))
same = [list(llm.generate([ids], sp)[0].outputs[0].token_ids) for llm in llms.values()]
print("outputs identical:", same[0] == same[1])
