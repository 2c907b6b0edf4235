"""MoE speculation by trace replay: plain against speculative decode tok/s on a mixture-of-experts
GGUF, driven by the acceptance the real default model shows on the same prompts.

Random weights accept nothing and no real MoE model can be installed here, so (issue 34):
  1. suffix decoding runs on smollm2-135m (fixed k, greedy, one request at a time) over two
     prompt sets written for this benchmark (code edits; open chat; 8 each), recording per
     step the output position, the drafts proposed and how many were accepted;
  2. the MoE file runs each prompt plain (greedy), which gives the tokens it will produce;
  3. the trace is replayed on the MoE file through ``TraceReplayDrafter``, a test drafter (not
     in the method table) that proposes the MoE target's own tokens cut where the trace was
     cut: at output position p inside a recorded step (p0, drafts d, accepted a), the target's
     next p0 + a - p tokens, then wrong tokens up to p0 + d - p drafts. The adaptive controller
     chooses k live (priced by the experts the rows would touch); the replay drafter is
     self-sizing and confident, as suffix decoding is;
  4. plain and speculative runs alternate prompt by prompt; tok/s per set, the speculative
     output is checked equal to plain, and the expert predictor's quality is printed
     (``moe.ExpertSpread``: the share of a decode step's experts the previous step's accepted
     rows had touched, and the predicted count's mean relative error);
  5. what the start-up cost curve allows on the trace (``bounds``): each step's k chosen with
     hindsight, and every proposal verified whole, with rows priced as the curve has them and
     with each row's experts drawn apart at random. On session 28's run, code edits allowed
     1.61x / 1.41x with hindsight, and measured 1.275x.

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
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.sample.rejection_sampler import VerifyResult
from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer

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


@dataclass
class Trace:
    """One prompt's suffix-decoding steps on the reference model: (output position, drafts
    proposed, drafts accepted), in order."""

    prompt_token_ids: list[int]
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # the reference model's

    def windows(self) -> dict[int, tuple[int, int]]:
        """Per output position inside a drafted step: (correct drafts left, drafts left)."""
        out: dict[int, tuple[int, int]] = {}
        for p0, drafts, accepted in self.steps:
            for p in range(p0, p0 + min(accepted, drafts) + 1):
                out[p] = (p0 + accepted - p, p0 + drafts - p)
        return out


class TraceReplayDrafter(Proposer):
    """A test drafter (benchmarks only, never in the method table): the target's own tokens,
    cut where a recorded trace was cut (see the module docstring)."""

    free_drafts = True
    confident_drafts = True

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # prompt token ids -> (the target's greedy output, the trace's windows)
        self.plans: dict[tuple[int, ...], tuple[list[int], dict[int, tuple[int, int]]]] = {}

    def plan(self, prompt: list[int], target: list[int], trace: Trace) -> None:
        self.plans[tuple(prompt)] = (target, trace.windows())

    def propose(self, inp: DraftInput) -> DraftOutput:
        drafts = []
        for r in inp.requests:
            target, windows = self.plans[tuple(r.token_ids[: r.num_prompt_tokens])]
            p = r.next_position
            correct, total = windows.get(p, (0, 0))
            own = target[p : p + correct]
            wrong = [(t + 1) % self.vocab_size for t in target[p + len(own) : p + total]]
            drafts.append((own + wrong)[: r.max_num_drafts])
        return DraftOutput(drafts, [None] * len(drafts))


def chat_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in prompts
    ]


def record_traces(model: str, k: int, max_tokens: int, num_prompts: int) -> dict[str, list]:
    """Suffix decoding on the reference model, fixed k, each prompt alone: its steps."""
    spec = {"method": "suffix", "num_speculative_tokens": k, "adaptive": False}
    llm = LLM(model, max_num_seqs=1, speculative_config=spec)
    speculator = llm.engine.speculator
    current: list[Trace] = []
    step = speculator.step

    def recording_step(sched, results, hidden, update, requests) -> None:
        for s, r in zip(sched.scheduled, results):
            if isinstance(r, VerifyResult) and len(s.token_ids) == 1 + s.num_drafts:
                p0 = s.start_pos + 1 - len(requests[s.req_id].prompt_token_ids)
                current[-1].steps.append((p0, s.num_drafts, r.num_accepted))
        step(sched, results, hidden, update, requests)

    speculator.step = recording_step
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    traces: dict[str, list] = {}
    for name, prompts in SETS.items():
        traces[name] = []
        for ids in chat_ids(llm, prompts[:num_prompts]):
            current.append(Trace(ids))
            out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
            current[-1].output_token_ids = list(out.outputs[0].token_ids)
            traces[name].append(current[-1])
    return traces


def _timed(llm: LLM, ids: list[int], sampling: SamplingParams) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), time.perf_counter() - start


def replay(moe: str, traces: dict[str, list[Trace]], k: int, max_tokens: int, rounds: int) -> dict:
    """Plain and trace-replayed speculative decoding on the MoE file, alternating per prompt."""
    spec = {"method": "suffix", "num_speculative_tokens": k}
    llm = LLM(moe, max_num_seqs=1, speculative_config=spec)
    speculator = llm.engine.speculator
    drafter = TraceReplayDrafter(llm.engine.model.cfg.vocab_size)
    speculator.proposer = drafter
    drafter.cost_model = speculator.controller.cost
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    speculator.enabled = False
    llm.generate([{"prompt_token_ids": traces["code_edit"][0].prompt_token_ids}], sampling)
    result: dict = {"cost": _cost_summary(speculator.controller.cost)}
    for name, set_traces in traces.items():
        spread = speculator.spread
        if spread is not None:
            spread.num_hit = spread.num_touched = 0
            spread.abs_error = spread.num_predicted = 0.0
        row = _run_set(llm, drafter, name, set_traces, sampling, rounds)
        row["bounds"] = {
            routing: bounds(set_traces, curve, k, max_tokens)
            for routing, curve in _curves(speculator).items()
        }
        if spread is not None:
            row["expert_hit_fraction"] = spread.hit_fraction
            row["expert_count_error"] = spread.count_error
            row["route_locality"] = route_locality(llm, set_traces)
        result[name] = row
    return result


_COUNTS = ("num_decisions", "num_chosen_drafts", "num_draft_tokens", "num_accepted_tokens")


def _run_set(
    llm: LLM,
    drafter: TraceReplayDrafter,
    name: str,
    traces: list[Trace],
    sampling: SamplingParams,
    rounds: int,
) -> dict:
    """Each prompt plain (its tokens plan the drafter), then plain and speculative, alternating
    which goes first; the speculative output must equal plain."""
    speculator = llm.engine.speculator
    ms = {"plain": 0.0, "spec": 0.0}
    num_tokens, counts = 0, dict.fromkeys(_COUNTS, 0)
    # per prompt and round: tokens, plain ms, speculative ms (which prompt a set's ratio owes to)
    per_prompt: list[dict] = []
    for _ in range(rounds):
        for i, trace in enumerate(traces):
            speculator.enabled = False
            plain, _ = _timed(llm, trace.prompt_token_ids, sampling)
            drafter.plan(trace.prompt_token_ids, plain, trace)
            prompt_ms = {}
            for kind in ("plain", "spec") if i % 2 else ("spec", "plain"):
                speculator.enabled = kind == "spec"
                before = {c: getattr(speculator.stats, c) for c in _COUNTS}
                out, sec = _timed(llm, trace.prompt_token_ids, sampling)
                if out != plain:
                    raise SystemExit(f"{name} prompt {i}: speculative output differs")
                ms[kind] += 1000.0 * sec
                prompt_ms[kind] = round(1000.0 * sec, 1)
                for c in _COUNTS:
                    counts[c] += getattr(speculator.stats, c) - before[c]
            num_tokens += len(plain)
            per_prompt.append({"prompt": i, "tokens": len(plain), **prompt_ms})
    row = {
        "plain_tok_s": num_tokens / ms["plain"] * 1000.0,
        "spec_tok_s": num_tokens / ms["spec"] * 1000.0,
        "trace_mean_accepted": _mean_accepted(traces),
        "mean_chosen_k": counts["num_chosen_drafts"] / max(1, counts["num_decisions"]),
        "num_tokens": num_tokens,
        "drafts_verified": counts["num_draft_tokens"],
        "drafts_accepted": counts["num_accepted_tokens"],
        "per_prompt_ms": per_prompt,
    }
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    return row


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


def _mean_accepted(traces: list[Trace]) -> float:
    steps = [s for t in traces for s in t.steps]
    return sum(a for _, _, a in steps) / max(1, len(steps))


def _curves(speculator) -> dict[str, list[float]]:
    """A forward's cost by rows (index n - 1), as the start-up measurement has it ("alike": rows
    that touch one row's experts) and with each row's experts drawn apart at random (``top_k``
    of ``num_experts``, each distinct one at ``expert_ms``): real rows lie between."""
    cost, spread = speculator.controller.cost, speculator.spread
    curves = {"alike": list(cost.verify_ms)}
    if spread is not None and cost.expert_ms:
        e, k = cost.num_experts, spread.top_k
        curves["apart"] = [
            ms + cost.expert_ms * (e * (1 - (1 - k / e) ** (n + 1)) - cost.curve_experts)
            for n, ms in enumerate(cost.verify_ms)
        ]
    return curves


def bounds(traces: list[Trace], verify_ms: list[float], k: int, max_tokens: int) -> dict:
    """What a cost curve (``verify_ms[n - 1]``: a forward over n rows) allows on these traces,
    against plain's max_tokens one-row steps: ``hindsight``, each step's k chosen
    knowing how many drafts will survive (k = the correct drafts left, or any smaller k where
    that costs less: a shortest path over output positions); ``whole``, every proposal verified
    whole (suffix decoding's own drafts, capped at k). Neither counts the time between forwards
    (sampling, scheduling), which a step with drafts saves too."""
    k = min(k, len(verify_ms) - 1)
    plain = hindsight = whole = 0.0
    for trace in traces:
        windows, n = trace.windows(), max_tokens
        best = [0.0] * (n + 1)  # best[p]: least cost from output position p to the end
        for p in range(n - 1, -1, -1):
            correct = min(windows.get(p, (0, 0))[0], k)
            best[p] = min(verify_ms[j] + best[min(n, p + j + 1)] for j in range(correct + 1))
        p = 0
        while p < n:
            correct, total = windows.get(p, (0, 0))
            total = min(total, k)
            whole += verify_ms[total]
            p += min(correct, total) + 1
        plain += n * verify_ms[0]
        hindsight += best[0]
    return {"hindsight": plain / hindsight, "whole": plain / whole}


def _cost_summary(cost) -> dict:
    return {
        "verify_ms": [round(x, 3) for x in cost.verify_ms[:9]],
        "expert_ms": cost.expert_ms,
        "curve_experts": cost.curve_experts,
        "num_experts": cost.num_experts,
    }


def load_or_record(path: Path | None, args: argparse.Namespace) -> dict[str, list[Trace]]:
    if path is not None and path.exists():
        raw = json.loads(path.read_text())
        if raw["settings"] != _settings(args):
            raise SystemExit(f"{path} was recorded with {raw['settings']}: remove it or match")
        return {
            name: [
                Trace(t["prompt_token_ids"], [tuple(s) for s in t["steps"]], t["output_token_ids"])
                for t in ts
            ]
            for name, ts in raw["traces"].items()
        }
    traces = record_traces(args.target, args.k, args.max_tokens, args.num_prompts)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "settings": _settings(args),
            "traces": {n: [t.__dict__ for t in ts] for n, ts in traces.items()},
        }
        path.write_text(json.dumps(payload))
    return traces


def _settings(args: argparse.Namespace) -> dict:
    return {"target": args.target, "k": args.k, "max_tokens": args.max_tokens,
            "num_prompts": args.num_prompts}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe", required=True, help="the mixture-of-experts GGUF to replay on")
    ap.add_argument("--target", default="smollm2-135m", help="the model the trace is recorded on")
    ap.add_argument("--k", type=int, default=8, help="suffix decoding's cap (trace and replay)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8, help="per set (at most 8)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--trace", type=Path, default=None, help="JSON: reused if present, else written"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()
    traces = load_or_record(args.trace, args)
    result = replay(args.moe, traces, args.k, args.max_tokens, args.rounds)
    result["settings"] = {**_settings(args), "moe": args.moe, "rounds": args.rounds}
    print(f"cost: {result['cost']}")
    print(
        "| set | plain tok/s | spec tok/s | speedup | trace accepted/step | mean k "
        "| drafts verified / accepted / tokens | expert hit | count err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in SETS:
        r = result[name]
        print(
            f"| {name} | {r['plain_tok_s']:.2f} | {r['spec_tok_s']:.2f} | {r['speedup']:.3f} | "
            f"{r['trace_mean_accepted']:.2f} | {r['mean_chosen_k']:.2f} | "
            f"{r['drafts_verified']} / {r['drafts_accepted']} / {r['num_tokens']} | "
            f"{r.get('expert_hit_fraction', float('nan')):.3f} | "
            f"{r.get('expert_count_error', float('nan')):.3f} |"
        )
    for name in SETS:
        for routing, b in result[name]["bounds"].items():
            print(
                f"{name}, forwards priced with rows routed {routing}: k chosen with hindsight "
                f"{b['hindsight']:.3f}x plain, every proposal verified whole {b['whole']:.3f}x"
            )
    for name in SETS:
        if "route_locality" in result[name]:
            loc = result[name]["route_locality"]
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
