"""Structured output on smollm2-135m: JSON-schema extraction prompts (nested objects, enums)
written over texts of the benchmark sets (GSM8K word problems, HumanEval signatures, stdlib code
edits), batch 1, greedy, 256 tokens. Configs, interleaved prompt by prompt:

- ``free``: plain decoding, no constraint (the same prompts);
- ``json``: plain decoding constrained by the schema;
- ``json+suffix``: suffix decoding plus grammar-forced drafts, constrained by the schema.

Reports tok/s, constrained/unconstrained and speculative/plain ratios, whether the constrained
outputs are identical with and without speculation, and the grammar's own time per token (masks,
draft checks, forced bytes, following the output).

    .venv/bin/python benchmarks/structured_output.py --data ../shared/bench/data --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import specdec  # noqa: F401 - before torch (OMP_WAIT_POLICY)

PROBLEM = {
    "type": "object",
    "properties": {
        "topic": {"enum": ["money", "time", "distance", "counting", "shopping", "other"]},
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
                "required": ["name", "role"],
                "additionalProperties": False,
            },
        },
        "quantities": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "value": {"type": "number"},
                    "unit": {"type": "string"},
                    "what": {"type": "string"},
                },
                "required": ["value", "unit", "what"],
                "additionalProperties": False,
            },
        },
        "question": {"type": "string"},
    },
    "required": ["topic", "people", "quantities", "question"],
    "additionalProperties": False,
}
FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "type": {"enum": ["int", "float", "str", "bool", "list", "dict", "other"]},
                },
                "required": ["name", "type"],
                "additionalProperties": False,
            },
        },
        "returns": {"enum": ["int", "float", "str", "bool", "list", "dict", "None", "other"]},
        "summary": {"type": "string"},
    },
    "required": ["name", "parameters", "returns", "summary"],
    "additionalProperties": False,
}
EDIT = {
    "type": "object",
    "properties": {
        "function": {"type": "string"},
        "file": {"type": "string"},
        "change": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["rename", "add_argument", "docstring", "refactor", "other"]},
                "old": {"type": "string"},
                "new": {"type": "string"},
            },
            "required": ["kind", "old", "new"],
            "additionalProperties": False,
        },
        "risk": {"enum": ["low", "medium", "high"]},
    },
    "required": ["function", "file", "change", "risk"],
    "additionalProperties": False,
}


def prompts(data: Path, per_set: int) -> list[tuple[str, dict]]:
    """(user message, schema) pairs: per_set from each of three sets."""

    def rows(name: str) -> list[dict]:
        lines = (data / name).read_text().splitlines()
        return [json.loads(x) for x in lines[: per_set * 3] if x][:per_set]

    out = []
    for r in rows("gsm8k_test.jsonl"):
        out.append((f"Read this word problem and extract its people, quantities and question "
                    f"as JSON with the schema {json.dumps(PROBLEM)}.\n\n{r['turns'][0]}", PROBLEM))  # fmt: skip
    for r in rows("humaneval.jsonl"):
        out.append((f"Describe the function below as JSON with the schema {json.dumps(FUNCTION)}."
                    f"\n\n{r['turns'][0][:1500]}", FUNCTION))  # fmt: skip
    for r in rows("stdlib_edit.jsonl"):
        out.append((f"Summarise the requested edit as JSON with the schema {json.dumps(EDIT)}."
                    f"\n\n{r['turns'][0][:1500]}", EDIT))  # fmt: skip
    return out


class GrammarClock:
    """Time spent inside the grammar (llguidance calls and our mask handling)."""

    def __init__(self) -> None:
        from specdec.structured import grammar

        self.seconds = 0.0
        self.by_name: dict[str, float] = {}
        for name in ("masks", "accept", "valid_prefix", "forced_after"):
            setattr(grammar.Grammar, name, self._timed(name, getattr(grammar.Grammar, name)))

    def _timed(self, name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.seconds += dt
                self.by_name[name] = self.by_name.get(name, 0.0) + dt

        return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/bench/data"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-set", type=int, default=7, help="prompts from each of the 3 sets")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write per-prompt rows as JSON")
    args = ap.parse_args()
    from specdec import LLM, SamplingParams

    clock = GrammarClock()
    configs = {
        "free": (None, False),
        "json": (None, True),
        "json+suffix": ({"method": "suffix"}, True),
    }
    llms = {
        name: LLM(args.model, max_num_seqs=1, speculative_config=s)
        for name, (s, _) in configs.items()
    }
    tok = llms["free"].get_tokenizer()
    items = prompts(args.data, args.per_set)
    ids = [
        tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True)
        for m, _ in items
    ]  # fmt: skip
    for llm in llms.values():  # warm-up (and the grammar tokenizer, built once)
        llm.generate([ids[0]], SamplingParams(temperature=0, max_tokens=8,
                                              structured_outputs={"json": items[0][1]}))  # fmt: skip
    totals = {name: [0, 0.0] for name in configs}
    grammar_s, grammar_tokens = 0.0, 0
    by_name: dict[str, float] = {}
    texts: dict[str, list[list[int]]] = {name: [] for name in configs}
    rows = []
    for rnd in range(args.rounds):
        for i, ((_, schema), p) in enumerate(zip(items, ids)):
            order = list(configs) if (i + rnd) % 2 == 0 else list(reversed(configs))
            row = {"prompt": i}
            for name in order:
                spec, constrained = configs[name]
                sp = SamplingParams(
                    temperature=0, max_tokens=args.max_tokens,
                    structured_outputs={"json": schema} if constrained else None,
                )  # fmt: skip
                g0, n0 = clock.seconds, dict(clock.by_name)
                t0 = time.perf_counter()
                out = llms[name].generate([p], sp)[0]
                dt = time.perf_counter() - t0
                n = len(out.outputs[0].token_ids)
                totals[name][0] += n
                totals[name][1] += dt
                if name == "json":
                    grammar_s += clock.seconds - g0
                    grammar_tokens += n
                    for k, v in clock.by_name.items():
                        by_name[k] = by_name.get(k, 0.0) + v - n0.get(k, 0.0)
                if rnd == 0:
                    texts[name].append(out.outputs[0].token_ids)
                row[name] = {"tokens": n, "s": round(dt, 4), "finish": out.outputs[0].finish_reason}
                if name == "json" and rnd == 0:
                    row["text"] = out.outputs[0].text[:200]
            rows.append(row)
    tps = {name: n / s for name, (n, s) in totals.items()}
    st = llms["json+suffix"].engine.spec_stats
    valid = 0
    for t in texts["json"]:
        try:
            json.loads(tok.decode(t))
            valid += 1
        except ValueError:
            pass
    result = {
        "prompts": len(items),
        "rounds": args.rounds,
        "tok_per_s": {k: round(v, 1) for k, v in tps.items()},
        "constrained_over_free": round(tps["json"] / tps["free"], 3),
        "suffix_over_constrained_plain": round(tps["json+suffix"] / tps["json"], 3),
        "identical_with_speculation": sum(
            a == b for a, b in zip(texts["json"], texts["json+suffix"])
        ),
        "complete_json": valid,
        "mean_tokens": round(statistics.mean(len(t) for t in texts["json"]), 1),
        "grammar_us_per_token_plain": round(1e6 * grammar_s / max(1, grammar_tokens), 1),
        "grammar_us_per_token_plain_by_call": {
            k: round(1e6 * v / max(1, grammar_tokens), 1) for k, v in by_name.items()
        },
        "spec": {k: v for k, v in st.as_dict().items() if k != "accepted_per_pos"},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"result": result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
