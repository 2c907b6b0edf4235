"""MoE speculation by trace replay: each drafter's speedup on a mixture-of-experts GGUF, driven
by the acceptance the real default model shows on the same prompts: ``specdec bench replay``
(``specdec/bench/replay.py``, the one replay implementation) with this benchmark's two prompt
sets and the figures only a mixture of experts has.

Random weights accept nothing and no real MoE model can be installed here, so (issue 34):
  1. suffix decoding runs on smollm2-135m (greedy, one request at a time, every step drafting up
     to the cap) over two prompt sets written for this benchmark (code edits; open chat; 8 each):
     ``specdec bench replay record``;
  2. the MoE file runs each prompt plain, then replayed (``replay.ReplayDrafter``: the file's own
     tokens cut where the trace was cut) with the adaptive controller live, priced by the experts
     the rows would touch: ``specdec bench replay run``;
  3. the expert predictor's quality on the reference model's text (``route_locality``: the share
     of a decode step's experts the previous step's accepted rows had touched, and the predicted
     count's mean relative error);
  4. what the start-up cost curve allows on the trace (``replay.bounds``): each step's k chosen
     with hindsight, and every proposal verified whole, with rows priced as the curve has them
     and with each row's experts drawn apart at random.

Tiny check (seconds):
    .venv/bin/python benchmarks/make_synthetic_gguf.py --shape qwen3moe-tiny --types Q8_0
    .venv/bin/python benchmarks/moe_trace.py --moe bench_out/synthetic/qwen3moe-tiny-Q8_0.gguf \\
        --max-tokens 32 --num-prompts 2
The real shape (quiet machine, ~3 GB file):
    .venv/bin/python benchmarks/make_synthetic_gguf.py --shape qwen3-30b-a3b-8l --types Q4_K_M
    .venv/bin/python benchmarks/moe_trace.py \\
        --moe bench_out/synthetic/qwen3-30b-a3b-8l-Q4_K_M.gguf --trace bench_out/moe_trace.json \\
        --json bench_out/moe_trace_result.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.bench.replay import (
    RecordOptions,
    ReplayOptions,
    Trace,
    TraceFile,
    bounds,
    format_replay,
    record,
    run_replay,
)

if TYPE_CHECKING:
    from specdec import LLM

CODE_EDITS = [
    "Rename the variable `total` to `running_sum` everywhere in this function and return the "
    "whole function:\n\ndef accumulate(values):\n    total = 0\n    for v in values:\n"
    "        total += v\n        print('so far', total)\n    return total\n",
    "Add type hints to every parameter and the return value of this Python code; change "
    "nothing else:\n\ndef merge(left, right):\n    out = []\n    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            out.append(left[i]); i += 1\n        else:\n            out.append(right[j]); "
    "j += 1\n    return out + left[i:] + right[j:]\n",
    "Convert this JavaScript function to use `const` and arrow functions, keeping the logic "
    "identical:\n\nfunction countWords(text) {\n  var counts = {};\n  var words = "
    "text.split(' ');\n  for (var i = 0; i < words.length; i++) {\n    var w = "
    "words[i].toLowerCase();\n    counts[w] = (counts[w] || 0) + 1;\n  }\n  return counts;\n}\n",
    "Add a docstring to each method of this class and return the full class:\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def is_empty(self):\n"
    "        return not self.items\n",
    "Fix the off-by-one error in this loop and show the corrected code:\n\n"
    "def last_n(items, n):\n    result = []\n    for i in range(len(items) - n - 1, len(items)):\n"
    "        result.append(items[i])\n    return result\n",
    "Replace the print calls with logging calls (logger = logging.getLogger(__name__)) in this "
    "module and return the module:\n\nimport os\n\ndef load(path):\n    print('loading', path)\n"
    "    if not os.path.exists(path):\n        print('missing file', path)\n        return None\n"
    "    with open(path) as f:\n        data = f.read()\n    print('read', len(data), 'bytes')\n"
    "    return data\n",
    "Make this SQL query also return the customer's email, and order by total descending:\n\n"
    "SELECT c.id, c.name, SUM(o.amount) AS total\nFROM customers c\n"
    "JOIN orders o ON o.customer_id = c.id\nWHERE o.created_at >= '2024-01-01'\n"
    "GROUP BY c.id, c.name;\n",
    "Change this Go function to return an error instead of panicking, and update the body:\n\n"
    "func parsePort(s string) int {\n\tport, err := strconv.Atoi(s)\n\tif err != nil {\n"
    '\t\tpanic(err)\n\t}\n\tif port < 1 || port > 65535 {\n\t\tpanic("port out of range")\n'
    "\t}\n\treturn port\n}\n",
]
OPEN_CHAT = [
    "What are some good ways to stay focused when working from home?",
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Why is the sky blue during the day and red at sunset?",
    "I am planning a three-day trip to a city I have never visited. How should I plan it?",
    "Explain the difference between a virus and a bacterium in simple words.",
    "What should I consider when adopting a dog for the first time?",
    "Give me some ideas for a birthday party for a ten-year-old who loves science.",
    "How do I politely decline an invitation from a friend without hurting their feelings?",
]
SETS = {"code_edit": CODE_EDITS, "open_chat": OPEN_CHAT}


def record_sets(target: str, k: int, max_tokens: int, num_prompts: int) -> TraceFile:
    """Suffix decoding on the reference model over this benchmark's sets (as categories)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe_sets.jsonl"
        lines = [
            json.dumps({"id": f"{name}-{i}", "category": name, "turns": [text]})
            for name, prompts in SETS.items()
            for i, text in enumerate(prompts[:num_prompts])
        ]
        path.write_text("\n".join(lines) + "\n")
        opts = RecordOptions(target, ("suffix",), (str(path),), None, None, max_tokens, k, True)
        return record(opts)


def route_locality(llm: LLM, traces: list[Trace]) -> dict[str, float]:
    """The expert predictor (``moe.ExpertSpread``) on real text: the reference model's prompt +
    output run through the MoE file's routers in one forward, cut into the trace's steps (a
    step's rows: its input token and its drafts, taken as the text's own tokens; the accepted
    ones stay). ``hit``: the share of a step's experts the previous step's accepted rows
    touched; ``chance``: that share were the step's experts drawn at random; ``count_error``:
    the predicted distinct experts' mean relative error."""
    import torch

    from specdec.model.llama import SeqBatch
    from specdec.model.moe import ExpertSpread, expert_mask, latest_routes, moe_blocks

    model = llm.engine.model
    blocks, num_experts = moe_blocks(model), model.cfg.num_experts
    spread = ExpertSpread(num_experts, blocks[0].top_k)
    chance = 0.0
    for i, trace in enumerate(traces):
        ids = trace.prompt_token_ids + trace.output_token_ids
        kv = model.make_kv_cache(1, len(ids) + 1)
        with torch.inference_mode():
            model.forward(
                torch.tensor(ids), torch.arange(len(ids)), SeqBatch([0], [0], [len(ids)]), kv
            )
        routes = latest_routes(blocks)  # [n, L, k]
        base = len(trace.prompt_token_ids) - 1  # the row whose output is position 0
        spread.observe(str(i), routes[: base + 1], base + 1, decode=False)
        for p0, drafts, accepted in trace.steps:
            rows = routes[base + p0 : base + p0 + drafts + 1]
            if not len(rows):
                break
            prev = spread.requests[str(i)].last_set
            if prev is not None:
                step = expert_mask(rows, num_experts)
                chance += float((step.sum(axis=1) * prev.sum(axis=1)).sum()) / num_experts
            spread.observe(str(i), rows, min(accepted + 1, len(rows)), decode=True)
        spread.remove(str(i))
    return {
        "hit": spread.hit_fraction,
        "chance": chance / max(1, spread.num_touched),
        "count_error": spread.count_error,
    }


def _curves(speculator) -> dict[str, list[float]]:
    """A forward's cost by rows (index n - 1), as the start-up measurement has it ("alike": rows
    that touch one row's experts) and with each row's experts drawn apart at random (``top_k``
    of ``num_experts``, each distinct one at ``expert_ms``): real rows lie between."""
    cost, spread = speculator._measured_cost, speculator.spread
    curves = {"alike": list(cost.verify_ms)}
    if spread is not None and cost.expert_ms:
        e, k = cost.num_experts, spread.top_k
        curves["apart"] = [
            ms + cost.expert_ms * (e * (1 - (1 - k / e) ** (n + 1)) - cost.curve_experts)
            for n, ms in enumerate(cost.verify_ms)
        ]
    return curves


def moe_figures(k: int, max_tokens: int):
    """``run_replay``'s extra: per set, the bounds and the expert predictor's quality."""

    def extra(llm, tf: TraceFile) -> dict:
        speculator = llm.engine.speculator
        out = {}
        for name in SETS:
            traces = [t for t in tf.drafters["suffix"].requests if t.category == name]
            row = {
                "bounds": {
                    routing: bounds(traces, curve, k, max_tokens)
                    for routing, curve in _curves(speculator).items()
                }
            }
            if speculator.spread is not None:
                row["route_locality"] = route_locality(llm, traces)
            out[name] = row
        return out

    return extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe", required=True, help="the mixture-of-experts GGUF to replay on")
    ap.add_argument("--target", default="smollm2-135m", help="the model the trace is recorded on")
    ap.add_argument("--k", type=int, default=8, help="suffix decoding's cap (trace and replay)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8, help="per set (at most 8)")
    ap.add_argument(
        "--trace", type=Path, default=None, help="JSON: reused if present, else written"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()
    if args.trace is not None and args.trace.exists():
        tf = TraceFile.load(args.trace)
    else:
        tf = record_sets(args.target, args.k, args.max_tokens, args.num_prompts)
        if args.trace is not None:
            tf.save(args.trace)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = args.trace or Path(tmp) / "trace.json"
        if args.trace is None:
            tf.save(trace_path)
        opts = ReplayOptions(str(trace_path), args.moe, max_tokens=args.max_tokens)
        result = run_replay(opts, moe_figures(args.k, args.max_tokens))
    print(format_replay(result))
    for name, row in result["extra"].items():
        for routing, b in row["bounds"].items():
            print(
                f"{name}, forwards priced with rows routed {routing}: k chosen with hindsight "
                f"{b['hindsight']:.3f}x plain, every proposal verified whole {b['whole']:.3f}x"
            )
        if "route_locality" in row:
            loc = row["route_locality"]
            print(
                f"{name}: on the reference model's text, a step's accepted rows held "
                f"{loc['hit']:.3f} of the next step's experts (chance {loc['chance']:.3f}); "
                f"predicted distinct experts off by {loc['count_error']:.3f} (relative)"
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
