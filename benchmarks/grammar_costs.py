"""The grammar's own costs on smollm2-135m's tokenizer, outside the engine (warm caches):

- ``mask``: llguidance's per-token mask / accept / forced-token calls over a JSON output of the
  structured_output benchmark's PROBLEM schema (min and mean of 5 passes, us per token);
- ``replay``: which forced-draft rule guesses the model's own tokens: replay greedy
  constrained outputs of the benchmark prompts and count, at every position, how many drafted
  tokens match what the model wrote (every forced byte's tokens, the same without the last
  token, llguidance's fast-forward tokens);
- ``xgrammar``: xgrammar's mask on the same schema and output, if it is importable (it is not a
  dependency: ``pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi`` and
  ``PYTHONPATH=/tmp/xg``).

    .venv/bin/python benchmarks/grammar_costs.py mask
    .venv/bin/python benchmarks/grammar_costs.py replay --data ../shared/bench/data
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import specdec  # noqa: F401 - before torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_output import PROBLEM, prompts  # noqa: E402

OUTPUT = {
    "topic": "money",
    "people": [{"name": "Janet", "role": "duck owner"}],
    "quantities": [
        {"value": 16, "unit": "eggs", "what": "laid per day"},
        {"value": 3, "unit": "eggs", "what": "eaten"},
    ],
    "question": "How much does she make?",
}


def _tokenizer():
    from specdec.model.registry import resolve_model_path
    from specdec.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_file(resolve_model_path("smollm2-135m"))


def mask() -> None:
    from specdec.structured.grammar import GrammarCompiler

    tok = _tokenizer()
    comp = GrammarCompiler(tok, 49152, sorted(tok.eog_token_ids))
    ids = tok.encode(json.dumps(OUTPUT, indent=2), add_special_tokens=False)
    passes = []
    for _ in range(5):
        g = comp.compile({"json": PROBLEM})
        t = {"mask": 0.0, "accept": 0.0, "forced": 0.0}
        for x in ids:
            t0 = time.perf_counter()
            g.masks([])
            t1 = time.perf_counter()
            g.forced_after([], 32)
            t2 = time.perf_counter()
            assert g.accept(x)
            t3 = time.perf_counter()
            t["mask"] += t1 - t0
            t["forced"] += t2 - t1
            t["accept"] += t3 - t2
        passes.append({k: 1e6 * v / len(ids) for k, v in t.items()})
    out = {k: {"min": round(min(p[k] for p in passes), 1),
               "mean": round(sum(p[k] for p in passes) / 5, 1)} for k in passes[0]}  # fmt: skip
    try:
        out["xgrammar_mask"] = _xgrammar(tok, ids)
    except ImportError:
        out["xgrammar_mask"] = "not installed"
    print(json.dumps({"tokens": len(ids), "us_per_token": out}, indent=1))


def _xgrammar(tok, ids: list[int]) -> dict[str, float]:
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
    cg = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=49152))
    compiled = cg.compile_json_schema(json.dumps(PROBLEM))
    bitmask = xgr.allocate_token_bitmask(1, 49152)
    passes = []
    for _ in range(5):
        m = xgr.GrammarMatcher(compiled)
        s = 0.0
        for x in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            s += time.perf_counter() - t0
            assert m.accept_token(x)
        passes.append(1e6 * s / len(ids))
    return {"min": round(min(passes), 1), "mean": round(sum(passes) / 5, 1)}


def replay(data: Path, per_set: int) -> None:
    from specdec import LLM, SamplingParams

    llm = LLM("smollm2-135m", max_num_seqs=1)
    tok = llm.get_tokenizer()
    comp = llm.engine.grammar_compiler
    stats = {k: [0, 0] for k in ("every_forced_byte", "without_last_token", "ff_tokens")}
    for message, schema in prompts(data, per_set):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )
        sp = SamplingParams(temperature=0, max_tokens=128, structured_outputs={"json": schema})
        out = llm.generate([ids], sp)[0].outputs[0].token_ids
        g = comp.compile({"json": schema})
        m = g._m
        for i in range(len(out)):
            forced = m.compute_ff_bytes()
            every = g._tok.tokenize_bytes(forced) if forced else []
            drafts = {
                "every_forced_byte": every,
                "without_last_token": every[:-1],
                "ff_tokens": m.compute_ff_tokens(),
            }
            for k, d in drafts.items():
                ok = 0
                while ok < len(d) and i + ok < len(out) and d[ok] == out[i + ok]:
                    ok += 1
                stats[k][0] += len(d)
                stats[k][1] += ok
            m.consume_token(out[i])
    print(json.dumps({k: {"drafted": d, "right": r} for k, (d, r) in stats.items()}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["mask", "replay"])
    ap.add_argument("--data", type=Path, default=Path("../shared/bench/data"))
    ap.add_argument("--per-set", type=int, default=2)
    args = ap.parse_args()
    if args.what == "mask":
        mask()
    else:
        replay(args.data, args.per_set)


if __name__ == "__main__":
    main()
