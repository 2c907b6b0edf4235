"""``specdec bench replay record`` and its file: each drafter's steps on the real model.

``record``: the real model (greedy, one request at a time, ``"adaptive": false`` so that every
step proposes up to the cap) runs each prompt per drafter; per step it keeps the output position,
the drafts proposed, how many were accepted and how long the drafter's call took (``Trace``). At
any smaller k the same step would have had min(accepted, k) accepted: the drafts at k are the
first k of those at the cap. ``TraceFile`` saves and loads the recording; ``bounds`` prices it on
a cost curve. ``specdec.bench.replay`` runs it on another file.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.spec_decode.base import DraftInput, DraftOutput, Proposer

SCHEMA = "specdec.bench.replay_trace/1"
DEFAULT_METHODS = ("suffix", "ngram", "hybrid", "eagle3")


@dataclass
class Trace:
    """One request's recorded steps: (output position, drafts proposed, drafts accepted), in
    order, with per step the drafter's call time on the recording machine and whether a model
    (a head, a draft model) proposed it."""

    prompt_token_ids: list[int]
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # the recording model's
    req_id: str = ""
    category: str = ""
    draft_ms: list[float] = field(default_factory=list)  # per step
    model_drafted: list[bool] = field(default_factory=list)  # per step

    def windows(self) -> dict[int, tuple[int, int]]:
        """Per output position inside a drafted step: (correct drafts left, drafts left)."""
        return {p: (c, t) for p, (c, t, _) in self.window_steps().items()}

    def window_steps(self) -> dict[int, tuple[int, int, int]]:
        """Per output position inside a step: (correct drafts left, drafts left, step index)."""
        out: dict[int, tuple[int, int, int]] = {}
        for i, (p0, drafts, accepted) in enumerate(self.steps):
            for p in range(p0, p0 + min(accepted, drafts) + 1):
                out[p] = (p0 + accepted - p, p0 + drafts - p, i)
        return out

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "steps": [list(s) for s in self.steps]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Trace:
        raw = dict(raw)
        raw["steps"] = [tuple(s) for s in raw.get("steps", [])]
        return cls(**raw)


@dataclass
class DrafterTrace:
    """One drafter's recording: its cap, the controller traits of its proposer, its requests."""

    method: str
    k: int  # the cap it was recorded at (every step proposed up to it)
    free_drafts: bool
    confident_drafts: bool
    requests: list[Trace] = field(default_factory=list)

    @property
    def model_drafter(self) -> bool:
        return any(any(t.model_drafted) for t in self.requests)


@dataclass
class TraceFile:
    model: str  # the recording model
    max_tokens: int
    step_ms: float  # the recording model's one-row forward (scales model drafters' time)
    drafters: dict[str, DrafterTrace]
    environment: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "schema": SCHEMA,
            "model": self.model,
            "max_tokens": self.max_tokens,
            "step_ms": self.step_ms,
            "environment": self.environment,
            "drafters": {
                name: {
                    **{
                        f: getattr(d, f) for f in ("method", "k", "free_drafts", "confident_drafts")
                    },
                    "requests": [t.to_json() for t in d.requests],
                }
                for name, d in self.drafters.items()
            },
        }
        path.write_text(json.dumps(payload))

    @classmethod
    def load(cls, path: str | Path) -> TraceFile:
        raw = json.loads(Path(path).read_text())
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a replay trace ({SCHEMA})")
        drafters = {
            name: DrafterTrace(
                d["method"], d["k"], d["free_drafts"], d["confident_drafts"],
                [Trace.from_json(t) for t in d["requests"]],
            )
            for name, d in raw["drafters"].items()
        }  # fmt: skip
        return cls(raw["model"], raw["max_tokens"], raw["step_ms"], drafters, raw["environment"])


@dataclass
class RecordOptions:
    model: str = "smollm2-135m"
    methods: tuple[str, ...] = DEFAULT_METHODS
    prompts: tuple[str, ...] = ()  # JSONL sets (none: the package's own)
    categories: tuple[str, ...] | None = None
    num_prompts: int | None = None  # per category
    max_tokens: int = 128
    k: int | None = None  # every drafter's cap (None: each method's default)
    chat: bool | None = None  # None: when the model has a chat template
    threads: int | None = None


def _one_row_ms(model, context: int = 64) -> float:
    from specdec.bench.forward_cost import measure_forward_cost

    return measure_forward_cost(model, context, [1], repeats=9, warmup=2)[0]["ms"]


def _hook(llm, current: list[Trace]) -> None:
    """Wrap the speculator's step and the proposer's call to fill ``current[-1]``."""
    from specdec.sample.rejection_sampler import VerifyResult

    speculator = llm.engine.speculator
    proposer = speculator.proposer
    propose, step = proposer.propose, speculator.step
    last = [0.0, False]  # the latest call: ms, whether a model drafted
    # a head reads the target's states; a draft model times itself at start-up
    model_drafter = bool(proposer.hidden_layers) or (
        type(proposer).measure_cost is not Proposer.measure_cost
    )

    def timed_propose(inp: DraftInput) -> DraftOutput:
        head = getattr(proposer, "num_drafted", {}).get("head", 0)
        start = time.perf_counter()
        out = propose(inp)
        last[0] = 1000.0 * (time.perf_counter() - start)
        if hasattr(proposer, "num_drafted"):  # hybrid: did its head draft?
            last[1] = proposer.num_drafted.get("head", 0) > head
        else:
            last[1] = model_drafter
        return out

    def recording_step(sched, results, hidden, update, requests) -> None:
        for s, r in zip(sched.scheduled, results):
            if isinstance(r, VerifyResult) and len(s.token_ids) == 1 + s.num_drafts:
                trace = current[-1]
                p0 = s.start_pos + 1 - len(requests[s.req_id].prompt_token_ids)
                trace.steps.append((p0, s.num_drafts, r.num_accepted))
                trace.draft_ms.append(round(last[0], 4) if s.num_drafts else 0.0)
                trace.model_drafted.append(bool(last[1] and s.num_drafts))
                last[0], last[1] = 0.0, False
        step(sched, results, hidden, update, requests)

    proposer.propose = timed_propose
    speculator.step = recording_step


def record(opts: RecordOptions) -> TraceFile:
    """Each drafter on the real model, each prompt alone: its steps (see the module docstring)."""
    from specdec import LLM, SamplingParams
    from specdec.bench import report
    from specdec.bench.dataset import PromptBuilder, load_items

    items = load_items(list(opts.prompts) or None, opts.categories, opts.num_prompts)
    sampling = SamplingParams(temperature=0, max_tokens=opts.max_tokens, ignore_eos=True)
    drafters: dict[str, DrafterTrace] = {}
    step_ms = 0.0
    for method in opts.methods:
        spec: dict[str, Any] = {"method": method, "adaptive": False}
        if opts.k is not None:
            spec["num_speculative_tokens"] = opts.k
        kwargs = {"threads": opts.threads} if opts.threads else {}
        llm = LLM(opts.model, max_num_seqs=1, speculative_config=spec, **kwargs)
        if not step_ms:
            step_ms = _one_row_ms(llm.engine.model)
        tok = llm.get_tokenizer()
        chat = opts.chat if opts.chat is not None else bool(getattr(tok, "chat_template", None))
        builder = PromptBuilder(tok, chat)
        speculator = llm.engine.speculator
        proposer = speculator.proposer
        current: list[Trace] = []
        _hook(llm, current)
        d = DrafterTrace(method, speculator.max_k, proposer.free_drafts, proposer.confident_drafts)
        for item in items:
            ids = builder.prompt_ids(item, [])
            current.append(Trace(ids, req_id=item.id, category=item.category))
            out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
            current[-1].output_token_ids = list(out.outputs[0].token_ids)
            d.requests.append(current[-1])
        drafters[method] = d
        print(f"recorded {method}: k {d.k}, {_summary(d)}", flush=True)
        del llm
    env = report.collect_environment(opts.model, None, {"settings": _record_settings(opts)})
    return TraceFile(opts.model, opts.max_tokens, step_ms, drafters, env)


def _record_settings(opts: RecordOptions) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(opts).items()}


def _summary(d: DrafterTrace) -> str:
    steps = [s for t in d.requests for s in t.steps]
    drafted = [s for s in steps if s[1]]
    acc = sum(s[2] for s in steps) / max(1, len(steps))
    return f"{len(steps)} steps, {len(drafted)} with drafts, {acc:.2f} accepted per step"


def bounds(traces: list[Trace], verify_ms: list[float], k: int, max_tokens: int) -> dict:
    """What a cost curve (``verify_ms[n - 1]``: a forward over n rows) allows on these traces,
    against plain's max_tokens one-row steps: ``hindsight``, each step's k chosen
    knowing how many drafts will survive (k = the correct drafts left, or any smaller k where
    that costs less: a shortest path over output positions); ``whole``, every proposal verified
    whole (the drafter's own drafts, capped at k). Neither counts the time between forwards
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
