"""The MoE trace replay on a simulated clock: the suffix-decoding trace of ``moe_trace.py``
(``--trace`` JSON) driven through the adaptive controller with a scripted step cost, so that
expert pricing can be judged without a quiet machine (no model runs).

A verify step of n rows costs ``--step-ms`` + ``--row-ms`` per extra row + ``--expert-ms`` per
distinct expert per layer beyond top_k, the rows routed independently and uniformly (n rows
touch E (1 - (1 - k / E)^n) experts per layer; random weights route about so). Printed per set:
plain against speculative speedup, the controller with expert pricing, without it (the dense
rule: a confident drafter alone gets its cap) and an oracle that knows each step's accepted
length (the bound for any controller). The defaults are a paper estimate for
qwen3-30b-a3b-8l at Q4_K_M on 2 AVX2 cores (an expert's 2.65 MB x 8 layers at ~20 GB/s: 1.06 ms);
take the real ones from the ``cost:`` line ``moe_trace.py`` prints for the file (verify_ms[0],
its slope, expert_ms).

    .venv/bin/python benchmarks/moe_trace_sim.py --trace bench_out/moe_trace.json --expert-ms 1.06
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.bench.replay import Trace, TraceFile
from specdec.spec_decode.controller import CostModel, SpecController


def _traces(path: Path) -> dict[str, list[Trace]]:
    """The suffix-decoding trace's requests, by category (``moe_trace.py``'s sets)."""
    out: dict[str, list[Trace]] = {}
    for t in TraceFile.load(path).drafters["suffix"].requests:
        out.setdefault(t.category, []).append(t)
    return out


class World:
    """The scripted cost of a step and the experts its rows touch."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def spread(self, n: int) -> float:
        e, k = self.args.experts, self.args.top_k
        return e * (1 - (1 - k / e) ** n)

    def ms(self, n: int) -> float:
        a = self.args
        return a.step_ms + a.row_ms * (n - 1) + a.expert_ms * (self.spread(n) - a.top_k)


def controlled(traces: list[Trace], world: World, cap: int, priced: bool) -> float:
    """Speedup over plain with the controller choosing k (as the engine does for suffix)."""
    a = world.args
    clock = [0.0]
    cost = CostModel([world.ms(1) + a.row_ms * i for i in range(cap + 1)])
    cost.expert_ms, cost.curve_experts, cost.num_experts = a.expert_ms * priced, a.top_k, a.experts
    ctl = SpecController(cap, cost, clock=lambda: clock[0])
    spreads = [world.spread(n) for n in range(1, cap + 2)]
    total_ms = total_tokens = 0.0
    for i, trace in enumerate(traces):
        windows, p, n_out, req = trace.windows(), 0, len(trace.output_token_ids), str(i)
        while p < n_out:
            ctl.end_cycle()
            lim = min(cap, n_out - p - 1)
            k = 0
            if lim > 0:
                k = ctl.choose([req], [lim], [len(trace.prompt_token_ids) + p], True, True,
                               [spreads[: lim + 1]])[0]  # fmt: skip
            correct, total = windows.get(p, (0, 0))
            d, shadow = min(k, total), min(lim, total)
            accepted = min(d, correct)
            if not k and shadow:  # the engine scores the drafts it did not verify
                ctl.observe(req, shadow, min(shadow, correct))
            ctl.observe_drafts([req], [d])
            ms = world.ms(1 + d)
            clock[0] += ms / 1000.0
            if d:
                ctl.observe(req, d, accepted)
            ctl.observe_step(1, d, 1 + accepted, True, world.spread(1 + d))
            total_ms, total_tokens, p = total_ms + ms, total_tokens + 1 + accepted, p + 1 + accepted
        ctl.remove_request(req)
    return world.ms(1) / (total_ms / total_tokens)


def oracle(traces: list[Trace], world: World, cap: int) -> float:
    """Each step verifies the k that pays best knowing how many drafts would be accepted."""
    total_ms = total_tokens = 0.0
    for trace in traces:
        windows, p, n_out = trace.windows(), 0, len(trace.output_token_ids)
        while p < n_out:
            correct = min(windows.get(p, (0, 0))[0], cap, n_out - p - 1)
            k = max(range(correct + 1), key=lambda k: (1 + k) / world.ms(1 + k))
            total_ms, total_tokens, p = total_ms + world.ms(1 + k), total_tokens + 1 + k, p + 1 + k
    return world.ms(1) / (total_ms / total_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True, help="moe_trace.py's --trace JSON")
    ap.add_argument("--k", type=int, default=8, help="the cap")
    ap.add_argument("--step-ms", type=float, default=23.0, help="a 1-row step")
    ap.add_argument("--row-ms", type=float, default=3.0, help="each further row, experts apart")
    ap.add_argument("--expert-ms", type=float, default=1.06, help="per distinct expert per layer")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    world = World(args)
    print("| set | priced | unpriced | oracle |\n|---|---|---|---|")
    for name, traces in _traces(args.trace).items():
        priced = controlled(traces, world, args.k, True)
        unpriced = controlled(traces, world, args.k, False)
        print(f"| {name} | {priced:.3f} | {unpriced:.3f} | {oracle(traces, world, args.k):.3f} |")


if __name__ == "__main__":
    main()
