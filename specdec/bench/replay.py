"""``specdec bench replay``: each drafter's speedup at the model sizes users run, by replaying
recorded drafts on a random-weight GGUF of a real shape.

Random weights change no speed, but they accept nothing: acceptance comes from a real model.

``record`` (replay_trace.py, re-exported here with the trace file's classes and ``bounds``): the
real model (greedy, one request at a time, ``"adaptive": false`` so that every step proposes up
to the cap) runs each prompt per drafter; per step it keeps the output position, the drafts
proposed, how many were accepted and how long the drafter's call took (``Trace``). At any
smaller k the same step would have had min(accepted, k) accepted: the drafts at k are the first
k of those at the cap.

``run``: the file runs each prompt plain (greedy: its own tokens), then plain again and once per
drafter, in an order that rotates prompt by prompt, each drafter with the engine's adaptive
controller live and ``ReplayDrafter`` in the drafter's place: it proposes the
file's own next tokens cut where the recorded step was cut (at output position p inside a
recorded step (p0, drafts d, accepted a): the next p0 + a - p tokens right, then wrong tokens
up to p0 + d - p drafts), and it takes the time the drafter took. The target's forwards, the
verification, the controller's choice of k and the whole engine step are real; the drafter's
time is the recorded one (CPU drafters as measured; model drafters scaled by the target's
one-row step time against the recording model's, conservative for a head on a larger target).
The figures are replays and are labelled so.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.replay_trace import (
    DEFAULT_METHODS,
    SCHEMA,
    DrafterTrace,
    RecordOptions,
    Trace,
    TraceFile,
    _one_row_ms,
    bounds,
    record,
)
from specdec.config import EngineArgs
from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer
from specdec.spec_decode.controller import expected_tokens
from specdec.spec_decode.hybrid import PRIOR_RATE, RATE_WEIGHT

# the engine options ``replay run`` takes (its --model is the file replayed on)
REPLAY_ENGINE_ARGS = ("kernels", "quantization", "activation_dtype", "kv_cache_dtype", "threads")
# what the spec stats count, diffed around each replayed request
_COUNTS = ("num_decisions", "num_chosen_drafts", "num_draft_tokens", "num_accepted_tokens")

__all__ = [
    "DEFAULT_METHODS",
    "REPLAY_ENGINE_ARGS",
    "SCHEMA",
    "DrafterTrace",
    "ProposalLog",
    "RecordOptions",
    "ReplayDrafter",
    "ReplayOptions",
    "Trace",
    "TraceFile",
    "VerifiedStep",
    "bounds",
    "format_replay",
    "lscpu",
    "record",
    "run_replay",
    "run_replay_cli",
]


@dataclass
class _Plan:
    output_token_ids: list[int]  # the replay target's own greedy tokens
    windows: dict[int, tuple[int, int, int]]
    trace: Trace


@dataclass
class ProposalLog:
    """One replayed proposal: what the controller allowed, what was proposed, what was right."""

    position: int
    max_num_drafts: int
    num_drafts: int
    num_correct: int  # of the proposed: the target's own tokens (the most that can be accepted)
    recorded_accepted: int  # the recorded step's acceptance left at this position
    shadow: bool


@dataclass
class VerifiedStep:
    """One replayed step's verification: the k the controller allowed, the drafts verified,
    how many the target accepted and how many the recording had right from there."""

    position: int
    k: int
    num_drafts: int
    num_accepted: int
    recorded_correct: int


class ReplayDrafter(Proposer):
    """A recorded drafter replayed on another target (benchmarks only, never in the method
    table): the target's own tokens, cut where the recording was cut, taking the recorded time."""

    def __init__(self, trace: DrafterTrace, vocab_size: int, model_scale: float) -> None:
        self.free_drafts = trace.free_drafts
        self.confident_drafts = trace.confident_drafts
        self.max_drafts = trace.k
        self.vocab_size = vocab_size
        self.model_scale = model_scale  # model drafters' time: target step here / at recording
        self.plans: dict[tuple[int, ...], _Plan] = {}
        self.log: list[ProposalLog] = []
        self.verified: list[VerifiedStep] = []
        # A confident proposer with a model inside (hybrid: suffix decoding, else its head)
        # prices the head's drafts itself at the target's costs (spec_decode/hybrid.py): the
        # recording's choices were made at the recording model's prices, so here each head step
        # is chosen again, by the head's running rates per position at this file's prices.
        self.head_rates: list[float] | None = None
        if trace.confident_drafts and any(any(t.model_drafted) for t in trace.requests):
            self.head_rates = [PRIOR_RATE] * trace.k
        self.head_skipped = 0  # recorded head steps not taken here (the head would not pay)

    def plan(self, trace: Trace, target_token_ids: list[int]) -> None:
        self.plans[tuple(trace.prompt_token_ids)] = _Plan(
            target_token_ids, trace.window_steps(), trace
        )

    def draft_ms(self, trace: Trace, step: int, num_drafts: int) -> float:
        """What the recorded call would take here for ``num_drafts`` drafts: a CPU drafter's
        whole call; a model drafter's per draft, scaled to this target."""
        ms, (_, drafted, _) = trace.draft_ms[step], trace.steps[step]
        if not trace.model_drafted[step]:
            return ms
        return ms / max(1, drafted) * num_drafts * self.model_scale

    def propose(self, inp: DraftInput) -> DraftOutput:
        drafts, wait_ms = [], 0.0
        for r in inp.requests:
            plan = self.plans[tuple(r.token_ids[: r.num_prompt_tokens])]
            p, target = r.next_position, plan.output_token_ids
            correct, total, step = plan.windows.get(p, (0, 0, -1))
            own = target[p : p + correct]
            wrong = [(t + 1) % self.vocab_size for t in target[p + len(own) : p + total]]
            d = (own + wrong)[: r.max_num_drafts]
            if step >= 0 and d and self.head_rates is not None and plan.trace.model_drafted[step]:
                d = d[: self._head_drafts(plan.trace, step, len(d))]
                self.head_skipped += not d
            if step >= 0 and d:
                wait_ms += self.draft_ms(plan.trace, step, len(d))
            self.log.append(
                ProposalLog(p, r.max_num_drafts, len(d), min(len(own), len(d)), correct, r.shadow)
            )
            drafts.append(d)
        _spin(wait_ms)
        return DraftOutput(drafts, [None] * len(drafts))

    def _head_drafts(self, trace: Trace, step: int, available: int) -> int:
        """How many of a recorded head step's drafts hybrid would take at this file's prices
        (0: none): the best expected tokens per ms, as HybridProposer._best_drafts prices it."""
        assert self.head_rates is not None
        cost = self.cost_model
        if cost is None:
            return available
        per_draft = self.draft_ms(trace, step, 1)
        best, best_j = 1.0 / cost.step_ms(1, 0), 0
        for j in range(1, min(available, len(self.head_rates)) + 1):
            ms = cost.step_ms(1 + j, j, draft_ms=per_draft * (1 + j))
            value = expected_tokens(self.head_rates, j) / ms
            if value > best:
                best, best_j = value, j
        return best_j

    def note_verified(
        self, prompt_token_ids: list[int], position: int, num_drafts: int, num_accepted: int
    ) -> None:
        plan = self.plans[tuple(prompt_token_ids)]
        correct, _, step = plan.windows.get(position, (0, 0, -1))
        if self.head_rates is not None and step >= 0 and plan.trace.model_drafted[step]:
            rates = self.head_rates
            for i in range(min(num_accepted + 1, num_drafts, len(rates))):
                rates[i] += RATE_WEIGHT * (float(i < num_accepted) - rates[i])
        k = next(
            (
                e.max_num_drafts
                for e in reversed(self.log)
                if e.position == position and not e.shadow
            ),
            0,
        )
        self.verified.append(VerifiedStep(position, k, num_drafts, num_accepted, correct))

    def mean_draft_ms_per_token(self, requests: list[Trace]) -> float:
        """A model drafter's time per draft here (the controller's start-up price)."""
        per = [
            t.draft_ms[i] / s[1] * self.model_scale
            for t in requests
            for i, s in enumerate(t.steps)
            if s[1] and t.model_drafted[i]
        ]
        return statistics.mean(per) if per else 0.0


def _watch(speculator) -> None:
    """Tell the replay drafter in place what each of its steps' verification accepted."""
    from specdec.sample.rejection_sampler import VerifyResult

    step = speculator.step

    def watched(sched, results, hidden, update, requests) -> None:
        drafter = speculator.proposer
        if speculator.enabled and isinstance(drafter, ReplayDrafter):
            for s, r in zip(sched.scheduled, results):
                if isinstance(r, VerifyResult) and len(s.token_ids) == 1 + s.num_drafts:
                    prompt = requests[s.req_id].prompt_token_ids
                    p = s.start_pos + 1 - len(prompt)
                    drafter.note_verified(prompt, p, s.num_drafts, r.num_accepted)
        step(sched, results, hidden, update, requests)

    speculator.step = watched


def _spin(ms: float) -> None:
    """Hold the thread ``ms`` milliseconds, busy (a drafter computes; it does not sleep)."""
    if ms <= 0:
        return
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


@dataclass
class ReplayOptions:
    trace: str
    model: str  # the GGUF (random weights of a real shape) replayed on
    methods: tuple[str, ...] | None = None  # None: every drafter in the trace
    categories: tuple[str, ...] | None = None
    max_tokens: int | None = None  # None: the trace's
    model_scale: float | None = None  # None: this file's one-row step / the recording model's
    engine: EngineArgs | None = None  # engine options (REPLAY_ENGINE_ARGS); model is ``model``
    context: int | None = None  # forward-cost's context (None: the mean prompt length)
    ns: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    repeats: int = 5
    bandwidth_gib: float = 1.0  # 0: skip the bandwidth measurement and the roof
    json_path: str | None = None


@dataclass
class _Arm:
    """One replayed drafter's engine state, kept across requests as one engine keeps it."""

    name: str
    trace: DrafterTrace
    drafter: ReplayDrafter
    controller: Any
    dormant: bool
    by_req: dict[str, Trace]


def _engine(opts: ReplayOptions, max_k: int, max_len: int):
    from specdec import LLM

    spec = {"method": "ngram", "num_speculative_tokens": max_k}  # replaced by each arm's drafter
    engine = (opts.engine or EngineArgs()).replace(
        model=opts.model, speculative_config=spec, max_num_seqs=1, max_model_len=max_len,
        enable_prefix_caching=False,
    )  # fmt: skip
    return LLM.from_engine_args(engine)


def _make_arm(llm, name: str, d: DrafterTrace, scale: float) -> _Arm:
    from specdec.spec_decode.controller import SpecController

    speculator = llm.engine.speculator
    drafter = ReplayDrafter(d, llm.engine.model.cfg.vocab_size, scale)
    cost = copy.deepcopy(speculator._measured_cost)
    cost.draft_ms_per_token = drafter.mean_draft_ms_per_token(d.requests)
    cost.catch_up_ms_per_token = 0.0
    controller = SpecController(min(d.k, speculator.max_k), cost)
    arm = _Arm(name, d, drafter, controller, False, {t.req_id: t for t in d.requests})
    _use(speculator, arm)
    arm.dormant = speculator._cannot_pay()
    return arm


def _use(speculator, arm: _Arm | None) -> None:
    """Put ``arm``'s drafter and controller in the engine (None: plain decoding)."""
    speculator._shadow.clear()
    if arm is None:
        speculator.enabled = False
        return
    speculator.enabled = True
    speculator.proposer = arm.drafter
    speculator.controller = arm.controller
    speculator.max_k = arm.controller.max_k
    speculator.dormant = arm.dormant
    arm.drafter.cost_model = arm.controller.cost


def _timed(llm, ids: list[int], sampling) -> tuple[list[int], float]:
    """Greedy tokens and the decode seconds (first token to last: the prompt is not counted)."""
    out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
    m = out.metrics
    return list(out.outputs[0].token_ids), m.finished_time - m.first_token_time


def _requests(tf: TraceFile, names: list[str], categories) -> list[tuple[str, str, list[int]]]:
    """(req_id, category, prompt ids) of every recorded request, in the recording's order."""
    seen: dict[str, tuple[str, str, list[int]]] = {}
    for name in names:
        for t in tf.drafters[name].requests:
            if categories and t.category not in categories:
                continue
            seen.setdefault(t.req_id, (t.req_id, t.category, t.prompt_token_ids))
    return list(seen.values())


def run_replay(
    opts: ReplayOptions, extra: Callable[[Any, TraceFile], dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Plain and every drafter replayed on ``opts.model`` (see the module docstring).
    ``extra(llm, trace_file)``, when given, adds its own figures (``result["extra"]``)."""
    from specdec import SamplingParams

    tf = TraceFile.load(opts.trace)
    names = list(opts.methods or tf.drafters)
    missing = [n for n in names if n not in tf.drafters]
    if missing:
        raise ValueError(
            f"{opts.trace} has no {', '.join(missing)} (it has {', '.join(tf.drafters)})"
        )
    max_tokens = opts.max_tokens or tf.max_tokens
    reqs = _requests(tf, names, opts.categories)
    if not reqs:
        raise ValueError("no recorded requests selected")
    max_k = max(tf.drafters[n].k for n in names)
    longest = max(len(ids) for _, _, ids in reqs)
    llm = _engine(opts, max_k, longest + max_tokens + max_k + 16)
    model, speculator = llm.engine.model, llm.engine.speculator
    vocab = model.cfg.vocab_size
    if any(max(ids) >= vocab for _, _, ids in reqs):
        raise ValueError(f"the trace's prompts use token ids beyond {opts.model}'s vocabulary")
    step_ms = _one_row_ms(model)
    scale = opts.model_scale if opts.model_scale is not None else step_ms / tf.step_ms
    arms = [_make_arm(llm, n, tf.drafters[n], scale) for n in names]
    _watch(speculator)
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _use(speculator, None)
    _timed(llm, reqs[0][2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    rows = {(n, c): _Acc() for n in ["plain", *names] for c in {c for _, c, _ in reqs}}
    for i, (req_id, category, ids) in enumerate(reqs):
        _use(speculator, None)
        plain, _ = _timed(llm, ids, sampling)  # the file's own tokens, which plan the drafters
        # NOTE: timed plain runs in the rotation too, so a drift hits it as it hits the drafters
        turns: list[_Arm | None] = [None, *arms]
        for arm in turns[i % len(turns) :] + turns[: i % len(turns)]:
            if arm is not None and req_id not in arm.by_req:
                continue
            if arm is not None:
                arm.drafter.plan(arm.by_req[req_id], plain)
            _use(speculator, arm)
            name = "plain" if arm is None else arm.name
            before = {c: getattr(speculator.stats, c) for c in _COUNTS}
            out, sec = _timed(llm, ids, sampling)
            if out != plain:
                raise RuntimeError(f"{name} on {req_id}: the output differs from the first plain")
            counts = {c: getattr(speculator.stats, c) - before[c] for c in _COUNTS}
            rows[name, category].add(len(out) - 1, sec, counts if arm is not None else None)
        print(f"replayed {req_id} ({i + 1}/{len(reqs)})", flush=True)
    _use(speculator, None)
    result = _result(opts, tf, llm, names, rows, step_ms, scale, arms, max_k, reqs, max_tokens)
    result["verified"] = {a.name: _verified_summary(a.drafter.verified) for a in arms}
    if extra is not None:
        result["extra"] = extra(llm, tf)
    return result


def _verified_summary(steps: list[VerifiedStep]) -> dict[str, Any]:
    """Each replayed step against the recording: accepted beyond k, beyond what was recorded
    right, or other than min(recorded right, drafts) (0, 0, 0: the replay is faithful)."""
    return {
        "num_steps": len(steps),
        "num_drafted": sum(1 for v in steps if v.num_drafts),
        "over_k": sum(1 for v in steps if v.num_accepted > v.k or v.num_drafts > v.k),
        "over_recorded": sum(1 for v in steps if v.num_accepted > v.recorded_correct),
        "mismatched": sum(
            1 for v in steps if v.num_accepted != min(v.recorded_correct, v.num_drafts)
        ),
        "steps": [dataclasses.astuple(v) for v in steps],
    }


@dataclass
class _Acc:
    tokens: int = 0
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))

    def add(self, tokens: int, seconds: float, counts: dict[str, int] | None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        for c, v in (counts or {}).items():
            self.counts[c] += v

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _result(opts, tf, llm, names, rows, step_ms, scale, arms, max_k, reqs, max_tokens) -> dict:
    from specdec.bench import report
    from specdec.bench.args import engine_settings
    from specdec.bench.forward_cost import measure_forward_cost

    model = llm.engine.model
    context = opts.context or int(statistics.mean(len(ids) for _, _, ids in reqs))
    ns = sorted({n for n in opts.ns if context + n + 1 <= model.max_len} | {1})
    cost = measure_forward_cost(model, context, ns, opts.repeats, warmup=1)
    roof = _roof(opts, model, context + max_tokens // 2)
    table = []
    for (name, category), acc in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        plain = rows["plain", category]
        c = acc.counts
        table.append({
            "drafter": name, "category": category, "tokens": acc.tokens,
            "tok_s": acc.tok_s, "speedup": acc.tok_s / plain.tok_s if plain.tok_s else 0.0,
            "mean_k": c["num_chosen_drafts"] / c["num_decisions"] if c["num_decisions"] else 0.0,
            "drafts_verified": c["num_draft_tokens"], "drafts_accepted": c["num_accepted_tokens"],
        })  # fmt: skip
    settings = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in dataclasses.asdict(opts).items()
        if k != "engine"
    }
    if opts.engine is not None:
        settings.update(engine_settings(opts.engine, REPLAY_ENGINE_ARGS))
    env = report.collect_environment(opts.model, opts.model, {"settings": settings})
    cfg = model.cfg
    return {
        "schema": "specdec.bench.replay/1",
        "environment": env,
        "lscpu": lscpu(),
        "shape": {
            "hidden": cfg.hidden_size,
            "layers": cfg.num_layers,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "vocab": cfg.vocab_size,
        },  # fmt: skip
        "quantization": _file_type(opts.model),
        "recording": {"model": tf.model, "step_ms": tf.step_ms, "max_tokens": tf.max_tokens},
        "step_ms": step_ms,
        "model_drafter_scale": scale,
        "dormant": {a.name: a.dormant for a in arms},
        "head_steps_skipped": {
            a.name: a.drafter.head_skipped for a in arms if a.drafter.head_rates is not None
        },
        "forward_cost": cost,
        "forward_cost_context": context,
        "roof": roof,
        "max_tokens": max_tokens,
        "rows": table,
    }


LSCPU_FIELDS = ("Model name", "CPU(s)", "Thread(s) per core", "Socket(s)", "L2 cache", "L3 cache")


def lscpu() -> dict[str, str]:
    """The machine as ``lscpu`` names it (empty where it is missing)."""
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in rows if k.strip() in LSCPU_FIELDS}


def _file_type(path: str) -> str:
    """The GGUF's file type (its most common weight format), e.g. Q4_0 or Q4_K."""
    try:
        import collections

        import gguf

        reader = gguf.GGUFReader(path)
        kinds = collections.Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
        return ", ".join(f"{k} x{n}" for k, n in kinds.most_common(3))
    except Exception:  # noqa: BLE001 - a label only
        return "unknown"


def _roof(opts: ReplayOptions, model, context: int) -> dict[str, float] | None:
    """Weight bytes + KV bytes at ``context`` over the read bandwidth: the fastest one-row step."""
    import torch

    from specdec.bench.roof import gguf_step_bytes, read_bandwidth

    if opts.bandwidth_gib <= 0:
        return None
    threads = (opts.engine and opts.engine.threads) or torch.get_num_threads()
    gbs = read_bandwidth(threads, opts.bandwidth_gib)
    cfg = model.cfg
    kv_elem = torch.finfo(model.kv_dtype).bits // 8 if model.kv_dtype.is_floating_point else 1
    head_dim = getattr(cfg, "head_dim", 0) or cfg.hidden_size // cfg.num_heads
    kv_mb = cfg.num_layers * 2 * cfg.num_kv_heads * head_dim * kv_elem * context / 1e6
    weight_mb = gguf_step_bytes(opts.model) / 1e6
    roof_ms = (weight_mb + kv_mb) / gbs
    return {"bandwidth_gbs": gbs, "threads": threads, "weight_mb": weight_mb, "kv_mb": kv_mb,
            "context": context, "roof_ms": roof_ms, "roof_tok_s": 1000.0 / roof_ms}  # fmt: skip


def format_replay(result: dict[str, Any]) -> str:
    """The printed report: machine, file, costs, roof, then per drafter and category."""
    env, shape, roof = result["environment"], result["shape"], result["roof"]
    cpu = result["lscpu"]
    lines = [
        "lscpu: " + "; ".join(f"{k} {v}" for k, v in cpu.items()),
        f"CPU: {env['cpu_model']} ({env['cpu_cores_usable']} usable cores, "
        f"torch threads {env['torch_threads']}, native kernels {env['native_kernels']})",
        f"file: {env['model']}",
        f"shape: hidden {shape['hidden']}, layers {shape['layers']}, heads {shape['heads']}, "
        f"kv heads {shape['kv_heads']}, vocab {shape['vocab']}; weights {result['quantization']}",
        f"recorded on {result['recording']['model']} (one-row step "
        f"{result['recording']['step_ms']:.2f} ms); here {result['step_ms']:.2f} ms: model "
        f"drafters' time x{result['model_drafter_scale']:.2f}",
    ]
    for name, v in result["verified"].items():
        if v["over_k"] or v["over_recorded"] or v["mismatched"]:
            lines.append(
                f"WARNING: {name}'s replay left the recording: {v['over_k']} steps beyond k, "
                f"{v['over_recorded']} beyond the recorded acceptance, {v['mismatched']} unlike it"
            )
    for name, n in result.get("head_steps_skipped", {}).items():
        lines.append(
            f"{name}: {n} recorded head steps not taken here (its head priced at this file's "
            "costs, as hybrid prices it)"
        )
    dormant = [n for n, d in result["dormant"].items() if d]
    if dormant:
        lines.append(f"dormant at start-up prices (plain decoding): {', '.join(dormant)}")
    rows = result["forward_cost"]
    lines.append(
        f"forward cost at context {result['forward_cost_context']} (N: ms): "
        + ", ".join(f"{r['n']}: {r['ms']:.1f}" for r in rows)
    )
    if roof:
        lines.append(
            f"read bandwidth {roof['bandwidth_gbs']:.1f} GB/s ({roof['threads']} threads); roof at "
            f"context {roof['context']}: ({roof['weight_mb']:.0f} MB weights + {roof['kv_mb']:.1f}"
            f" MB KV) / bandwidth = {roof['roof_ms']:.1f} ms, {roof['roof_tok_s']:.2f} tok/s"
        )
    lines += [
        "",
        "| category | drafter | tokens | decode tok/s | speedup (replayed) | mean k "
        "| drafts verified / accepted |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        replayed = r["drafter"] != "plain"
        lines.append(
            f"| {r['category']} | {r['drafter']} | {r['tokens']} | {r['tok_s']:.2f} | "
            + (f"{r['speedup']:.3f} (replayed)" if replayed else "1 (measured)")
            + f" | {r['mean_k']:.2f} | "
            + (f"{r['drafts_verified']} / {r['drafts_accepted']}" if replayed else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


def run_replay_cli(opts: ReplayOptions) -> dict[str, Any]:
    from specdec.bench import report

    result = run_replay(opts)
    print(format_replay(result))
    if opts.json_path:
        report.write_json(Path(opts.json_path), result)
        print(f"wrote {opts.json_path}")
    return result
