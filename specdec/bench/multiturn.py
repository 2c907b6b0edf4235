"""``specdec bench multiturn``: conversations and agent loops replayed turn by turn through the
OpenAI server, with the prefix cache on, for plain decoding and each drafter given.

Every configuration gets its own in-process server (``serve.InProcessServer``, engine flags as
``specdec serve``), all up at once. Each conversation is replayed on every server in turn (the
order rotating from one conversation to the next, so drift of a shared machine hits them alike),
one request at a time, greedy: each turn sends the whole history (the system prompt, the
earlier turns' messages and the model's own earlier answers, as a real client does) plus the
turn's new messages (a user message, or an agent's tool results) as one streaming chat
completion (``serve.stream_chat``). Before each conversation the server's prefix cache and its
drafter's memory of earlier requests (suffix decoding's global tree, the adaptive controller's
learnt state) are emptied: turn 1 starts cold, and later turns can reuse only their own
conversation's earlier turns.

Per (configuration, turn): prefix-cache hit rate = prompt tokens served from the prefix cache /
prompt tokens (the server's ``usage.prompt_tokens_details.cached_tokens``), mean acceptance
length and acceptance rate (the README's definitions, from the responses' ``spec_decode``
counters summed), TTFT p50, decode tokens/s = output tokens after the first / seconds after the
first token, and its ratio to plain's at the same turn. Rows ``3+`` and ``all`` pool the later
turns and every turn.

``--concurrency N`` replays N conversations at once on each server (caches emptied before each
group of N), as agent traffic arrives; ``--base-url LABEL=URL`` measures servers already running
(any OpenAI-compatible one: another specdec, vLLM, llama-server) instead of starting them, each
under its configuration's label (``plain=http://127.0.0.1:8000``); their caches cannot be emptied,
so a later conversation may reuse an earlier one's prefix.

Checks (a failure makes the exit code 1): every speculative reply equals plain's (same
conversation and turn, text and token count); and speculation never serves fewer prompt tokens
from the prefix cache than plain does for the same prompt (same conversation and turn, every
earlier reply identical).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec.bench import report
from specdec.bench.aggregate import merge_spec, percentile
from specdec.bench.args import SERVE_ENGINE_ARGS, add_command, csv, engine_settings, flag_values
from specdec.bench.configs import BenchConfig, parse_configs
from specdec.bench.dataset import WARMUP_PROMPT
from specdec.bench.report import fmt, loud, warn
from specdec.bench.serve import InProcessServer, stream_chat
from specdec.config import ConfigError, EngineArgs

SCHEMA = "specdec.bench.multiturn/1"
DEFAULT_CONVERSATIONS = Path(__file__).parent / "prompts" / "multiturn.json"
DEFAULT_METHODS = "plain,suffix,ngram,hybrid"
WARMUP_MAX_TOKENS = 16
LATER_TURNS = 3  # the pooled row "3+": turns from this one on
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Conversation:
    id: str
    category: str
    turns: list[list[dict[str, str]]]  # the messages sent before each answer
    system: str | None = None


def load_conversations(path: str | Path) -> list[Conversation]:
    """``{"conversations": [{"id", "category", "system"?, "turns": [...]}]}``; a turn is a user
    message (a string) or a list of ``{"role", "content"}`` messages."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))["conversations"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a conversations file ({type(e).__name__}: {e})") from e
    out: list[Conversation] = []
    for i, row in enumerate(rows):
        where = f"{path}: conversation {i}"
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or "id" not in row or "category" not in row:
            raise ValueError(f"{where}: needs 'id', 'category' and a non-empty 'turns' list")
        out.append(
            Conversation(
                str(row["id"]),
                str(row["category"]),
                [_turn_messages(t, f"{where}, turn {j + 1}") for j, t in enumerate(turns)],
                row.get("system"),
            )
        )
    ids = [c.id for c in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: conversation ids repeat")
    return out


def _turn_messages(turn: Any, where: str) -> list[dict[str, str]]:
    if isinstance(turn, str):
        return [{"role": "user", "content": turn}]
    ok = isinstance(turn, list) and turn
    ok = ok and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in turn
    )
    if not ok:
        raise ValueError(f"{where}: a string or a list of {{role, content}} messages")
    return [{"role": m["role"], "content": m["content"]} for m in turn]


def parse_methods(text: str) -> list[str]:
    """``plain,suffix,ngram:k=5,max=4`` -> ``["plain", "suffix", "ngram:k=5,max=4"]``: a part
    holding ``=`` but no ``:`` continues the previous configuration's options."""
    out: list[str] = []
    for part in csv(text):
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


@dataclass
class MultiturnOptions:
    engine: EngineArgs  # SERVE_ENGINE_ARGS on the command line (max_num_seqs defaults to 1)
    methods: list[str]
    conversations: str = str(DEFAULT_CONVERSATIONS)
    num_conversations: int | None = None  # the first N
    max_turns: int | None = None  # the first N turns of each
    max_tokens: int = 128
    request_timeout: float = 600.0
    output_dir: str | None = None
    concurrency: int = 1  # conversations replayed at once on each server
    base_urls: dict[str, str] | None = None  # label -> the URL of a server already running


MultiturnResult = report.BenchResult


# ---- the clients --------------------------------------------------------------------------------
async def run_conversation(
    url: str, model: str, conv: Conversation, max_tokens: int, request_timeout: float = 600.0
) -> list[dict]:
    """Every turn of one conversation, each answer fed back; one record per turn (1-based)."""
    import httpx

    messages: list[dict[str, str]] = []
    if conv.system:
        messages.append({"role": "system", "content": conv.system})
    rows: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=30.0)) as client:
        for turn, sent in enumerate(conv.turns, 1):
            messages.extend(sent)
            row = await stream_chat(client, url, model, messages, max_tokens, False)
            row.pop("start_perf")
            rows.append({"id": conv.id, "category": conv.category, "turn": turn, **row})
            if row["error"]:
                break
            messages.append({"role": "assistant", "content": row["text"]})
    return rows


# ---- the figures ----------------------------------------------------------------------------
def decode_tokens_per_s(rows: list[dict]) -> float | None:
    """Output tokens after the first / seconds after the first token, summed over ``rows``."""
    timed = [r for r in rows if r["ttft_s"] is not None and r["output_tokens"] > 1]
    seconds = sum(r["e2e_s"] - r["ttft_s"] for r in timed)
    return sum(r["output_tokens"] - 1 for r in timed) / seconds if seconds > 0 else None


def summarize_turns(rows: list[dict], label: str) -> dict:
    """Figures over the requests of one configuration at one turn (or a pool of turns)."""
    ok = [r for r in rows if not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_prompt_tokens"] for r in ok)
    compared = [r["identical_to_plain"] for r in ok if r.get("identical_to_plain") is not None]
    ttft = percentile([r["ttft_s"] for r in ok], 50)
    return {
        "turn": label,
        "num_requests": len(ok),
        "num_errors": len(rows) - len(ok),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "output_tokens": sum(r["output_tokens"] for r in ok),
        "ttft_ms_p50": None if ttft is None else 1000.0 * ttft,
        "decode_tokens_per_s": decode_tokens_per_s(ok),
        "spec_decode": merge_spec(ok),
        "num_compared": len(compared),
        "num_identical": sum(compared),
        "num_fewer_cached": sum(1 for r in ok if r.get("fewer_cached_than_plain")),
    }


def summarize(records: list[dict], configs: list[BenchConfig]) -> list[dict]:
    """Per configuration: one row per turn, then ``3+`` and ``all``; decode speedups over the
    reference's (the first configuration) row of the same label."""
    summary: list[dict] = []
    for cfg in configs:
        mine = [r for r in records if r["config"] == cfg.label]
        turns = sorted({r["turn"] for r in mine})
        groups = [(str(t), [r for r in mine if r["turn"] == t]) for t in turns]
        if any(t >= LATER_TURNS for t in turns):
            groups.append((f"{LATER_TURNS}+", [r for r in mine if r["turn"] >= LATER_TURNS]))
        groups.append(("all", mine))
        for label, rows in groups:
            summary.append({"config": cfg.label, **summarize_turns(rows, label)})
    ref = {s["turn"]: s for s in summary if s["config"] == configs[0].label}
    for s in summary:
        base = (ref.get(s["turn"]) or {}).get("decode_tokens_per_s")
        tps = s["decode_tokens_per_s"]
        s["decode_speedup"] = tps / base if tps and base else None
    return summary


def compare_to_reference(records: list[dict], reference: str) -> list[str]:
    """Sets ``identical_to_plain`` and ``fewer_cached_than_plain`` on every record of another
    configuration; returns the failures (replies that differ; fewer prompt tokens from the prefix
    cache than plain's for the same prompt)."""
    ref = {(r["id"], r["turn"]): r for r in records if r["config"] == reference and not r["error"]}
    failures: list[str] = []
    same_so_far: dict[tuple[str, str], bool] = {}  # (config, id): every earlier reply identical
    for r in sorted(records, key=lambda r: r["turn"]):
        r["identical_to_plain"] = r["fewer_cached_than_plain"] = None
        base = ref.get((r["id"], r["turn"]))
        if r["config"] == reference or base is None or r["error"]:
            continue
        where = f"{r['config']} / {r['id']} turn {r['turn']}"
        same = r["text"] == base["text"] and r["output_tokens"] == base["output_tokens"]
        r["identical_to_plain"] = same
        if not same:
            failures.append(f"{where}: the reply differs from plain's")
        key = (r["config"], r["id"])
        if same_so_far.get(key, True):  # the same prompt as plain's
            r["fewer_cached_than_plain"] = r["cached_prompt_tokens"] < base["cached_prompt_tokens"]
            if r["fewer_cached_than_plain"]:
                failures.append(
                    f"{where}: {r['cached_prompt_tokens']} prompt tokens from the prefix cache, "
                    f"plain {base['cached_prompt_tokens']}"
                )
        same_so_far[key] = same_so_far.get(key, True) and same
    return failures


def format_table(summary: list[dict], reference: str) -> str:
    """One row per (configuration, turn)."""
    head = (
        "| config | turn | requests | prompt tokens | cached | prefix hit rate | accept len "
        "| accept rate | TTFT p50 ms | decode tok/s | decode speedup | identical to plain |"
    )
    lines = [head, "|" + "---|" * 12]
    for s in summary:
        spec = s["spec_decode"]
        if s["config"] == reference:
            same = "reference"
        elif s["num_compared"]:
            same = f"{s['num_identical']}/{s['num_compared']}"
            same = same if s["num_identical"] == s["num_compared"] else f"**NO {same} FAIL**"
        else:
            same = "-"
        turn = f"**{s['turn']}**" if not s["turn"].isdigit() else s["turn"]
        cells = [
            s["config"],
            turn,
            str(s["num_requests"]) + (f" ({s['num_errors']} errors)" if s["num_errors"] else ""),
            str(s["prompt_tokens"]),
            str(s["cached_prompt_tokens"]),
            fmt(s["prefix_hit_rate"], ".1%"),
            fmt(spec["mean_acceptance_length"] if spec else None, ".2f"),
            fmt(spec["acceptance_rate"] if spec else None, ".2f"),
            fmt(s["ttft_ms_p50"], ".0f"),
            fmt(s["decode_tokens_per_s"], ".1f"),
            fmt(s["decode_speedup"], ".2f", "x"),
            same,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def later_turn_notes(summary: list[dict]) -> list[str]:
    """Per drafter: does acceptance on turns 3+ reach turn 1's (its memory of the conversation's
    earlier turns at work)?"""
    notes = []
    for cfg in dict.fromkeys(s["config"] for s in summary):
        rows = {s["turn"]: s for s in summary if s["config"] == cfg}
        first, later = rows.get("1"), rows.get(f"{LATER_TURNS}+")
        if not first or not later or not first["spec_decode"] or not later["spec_decode"]:
            continue
        a, b = first["spec_decode"], later["spec_decode"]
        verdict = ">=" if b["mean_acceptance_length"] >= a["mean_acceptance_length"] else "<"
        notes.append(
            f"{cfg}: acceptance length turns {LATER_TURNS}+ {b['mean_acceptance_length']:.2f} "
            f"{verdict} turn 1 {a['mean_acceptance_length']:.2f} (rate {b['acceptance_rate']:.2f}"
            f" vs {a['acceptance_rate']:.2f})"
        )
    return notes


# ---- the run -------------------------------------------------------------------------------------
class _External:
    """A server already running (``--base-url``): nothing to start, stop or empty."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url.rstrip("/"), name

    def reset_caches(self) -> None:
        pass

    def stop(self) -> None:
        pass


def parse_base_urls(values: list[str] | None) -> dict[str, str] | None:
    """``LABEL=URL`` values (``--base-url``) -> {label: url}; None when none are given."""
    if not values:
        return None
    out: dict[str, str] = {}
    for value in values:
        label, sep, url = value.partition("=")
        if not sep or not label.strip() or not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"--base-url {value!r}: expected LABEL=URL, e.g. plain=http://127.0.0.1:8000"
            )
        out[label.strip()] = url
    return out


class _Run:
    def __init__(self, opts: MultiturnOptions) -> None:
        from specdec.bench.latency import _validate_models
        from specdec.model.registry import resolve_model_path

        if not opts.engine.enable_prefix_caching:
            raise ConfigError("bench multiturn measures the prefix cache: leave it enabled")
        self.opts = opts
        methods = list(opts.base_urls) if opts.base_urls else opts.methods
        self.configs = parse_configs(methods)
        anchors = [c.label for c in self.configs if c.is_anchor]
        if anchors:
            raise ConfigError(f"bench multiturn measures our server only, not {', '.join(anchors)}")
        self.reference = self.configs[0].label
        convs = load_conversations(opts.conversations)[: opts.num_conversations]
        if opts.max_turns is not None:
            convs = [Conversation(c.id, c.category, c.turns[: opts.max_turns], c.system)
                     for c in convs]  # fmt: skip
        if not convs:
            raise ValueError("no conversations selected")
        self.conversations = convs
        if opts.base_urls:  # NOTE: the servers hold the model: nothing to read here
            self.model_path = Path(opts.engine.model)
        else:
            _validate_models(self.configs)
            self.model_path = resolve_model_path(opts.engine.model)
        self.records: list[dict] = []
        self.config_errors: dict[str, str] = {}

    def _start(self, servers: dict[str, InProcessServer]) -> None:
        """One server per configuration, each warmed up on a prompt in no conversation."""
        urls = self.opts.base_urls or {}
        for cfg in self.configs:
            try:
                if cfg.label in urls:
                    server: Any = _External(urls[cfg.label], self.opts.engine.model)
                else:
                    server = InProcessServer(
                        self.opts.engine, cfg, self.model_path, self.opts.concurrency
                    )
                servers[cfg.label] = server
                warm = Conversation(
                    "warmup", "warmup", [[{"role": "user", "content": WARMUP_PROMPT}]]
                )
                row = asyncio.run(
                    run_conversation(server.url, server.name, warm, WARMUP_MAX_TOKENS)
                )[0]
                if row["error"]:
                    warn(f"{cfg.label}: warm-up request failed: {row['error']}")
            except Exception as e:
                self._crashed(cfg, e)

    def _crashed(self, cfg: BenchConfig, e: Exception) -> None:
        if cfg.label == self.reference:
            raise e
        self.config_errors[cfg.label] = f"{type(e).__name__}: {e}"
        loud([f"FAILURE: {cfg.label} crashed: {type(e).__name__}: {e}"])
        traceback.print_exc()

    def _replay(self, server: Any, cfg: BenchConfig, group: list[Conversation]) -> None:
        """``group``'s conversations at once on ``server``, its caches emptied first."""
        server.reset_caches()

        async def replay_all() -> list[list[dict]]:
            return await asyncio.gather(*(
                run_conversation(
                    server.url, server.name, conv, self.opts.max_tokens, self.opts.request_timeout
                )
                for conv in group
            ))  # fmt: skip

        for conv, rows in zip(group, asyncio.run(replay_all())):
            for r in rows:
                r["config"] = cfg.label
                if cfg.is_plain:
                    r["spec_decode"] = None  # the server reports zero counters for plain
            self.records.extend(rows)
            hits = ", ".join(
                f"{r['cached_prompt_tokens']}/{r['prompt_tokens']}" for r in rows if not r["error"]
            )
            print(
                f"{cfg.label} / {conv.id}: {len(rows)} turns, cached prompt tokens {hits}",
                flush=True,
            )

    def execute(self) -> None:
        servers: dict[str, InProcessServer] = {}
        try:
            self._start(servers)
            n = self.opts.concurrency
            groups = [self.conversations[i : i + n] for i in range(0, len(self.conversations), n)]
            for i, group in enumerate(groups):
                live = [c for c in self.configs if c.label in servers]
                shift = i % len(live)
                for cfg in live[shift:] + live[:shift]:
                    if cfg.label in self.config_errors:
                        continue
                    try:
                        self._replay(servers[cfg.label], cfg, group)
                    except Exception as e:
                        self._crashed(cfg, e)
        finally:
            for server in servers.values():
                server.stop()
            servers.clear()
            gc.collect()


def run_multiturn(opts: MultiturnOptions) -> MultiturnResult:
    if opts.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if opts.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    for name in ("num_conversations", "max_turns"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    run = _Run(opts)
    out_dir = Path(opts.output_dir) if opts.output_dir else report.default_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    n = sum(len(c.turns) for c in run.conversations)
    print(f"{len(run.conversations)} conversations ({n} turns), configurations "
          f"{', '.join(c.label for c in run.configs)}, max_tokens {opts.max_tokens}, greedy; "
          f"output in {out_dir}")  # fmt: skip
    if opts.base_urls:
        warn("servers given by --base-url keep their caches between conversations: a later "
             "conversation may reuse an earlier one's prefix")  # fmt: skip
    run.execute()
    failures = compare_to_reference(run.records, run.reference)
    failures += [f"{label} crashed: {e}" for label, e in run.config_errors.items()]
    summary = summarize(run.records, run.configs)
    settings = asdict(opts)
    settings.pop("engine")
    settings.update(engine_settings(opts.engine, SERVE_ENGINE_ARGS))
    payload = {
        "schema": SCHEMA,
        "environment": report.collect_environment(
            opts.engine.model, str(run.model_path), {"settings": settings}
        ),
        "reference": run.reference,
        "greedy": True,
        "configs": [asdict(c) for c in run.configs],
        "conversations": [asdict(c) for c in run.conversations],
        "config_errors": run.config_errors,
        "failures": failures,
        "passed": not failures,
        "summary": summary,
        "later_turns": later_turn_notes(summary),
        "records": run.records,
    }
    table = format_table(summary, run.reference)
    notes = payload["later_turns"]
    if notes:
        table += "\n" + "\n".join(f"- {line}" for line in notes) + "\n"
    report.write_outputs(out_dir, payload, table)
    errors = [f"{r['config']} / {r['id']} turn {r['turn']}: {r['error']}"
              for r in run.records if r["error"]]  # fmt: skip
    return report.outcome(out_dir, payload, table, errors, failures)


# ---- the command ---------------------------------------------------------------------------------
MULTITURN_EPILOG = """\
--methods: comma-separated configurations as bench latency's (plain is added first when
missing); a method's own options follow it, e.g. plain,suffix,ngram:k=5,max=4,hybrid.
Conversations file: {"conversations": [{"id", "category", "system"?, "turns": [...]}]}, a turn
being a user message (a string) or a list of {"role", "content"} messages (tool results).

examples:
  specdec bench multiturn --model smollm2-135m --methods plain,suffix,ngram,hybrid \\
      --max-tokens 128
  specdec bench multiturn --model smollm2-135m --methods plain,suffix --concurrency 4
  specdec bench multiturn --model smollm2-135m \\
      --base-url plain=http://127.0.0.1:8000 --base-url suffix=http://127.0.0.1:8001
"""


def add_multiturn_parser(sub) -> None:
    p = add_command(
        sub,
        "multiturn",
        "conversations and agent loops through the server: per-turn prefix-cache hit rate, "
        "acceptance, TTFT, decode tokens/s",
        MULTITURN_EPILOG,
    )
    EngineArgs.add_cli_args(p, SERVE_ENGINE_ARGS, defaults={"max_num_seqs": None})
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="configurations to compare (default: %(default)s)")  # fmt: skip
    p.add_argument("--conversations", default=str(DEFAULT_CONVERSATIONS), metavar="FILE.json",
                   help="the conversations (default: the package's own hand-written set)")  # fmt: skip
    p.add_argument("--num-conversations", type=int, default=None, help="the first N only")
    p.add_argument("--max-turns", type=int, default=None, help="the first N turns of each")
    p.add_argument("--max-tokens", type=int, default=128, help="per answer (default: 128)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-dir", default=None, help="default: bench_out/<timestamp>")
    p.add_argument("--concurrency", type=int, default=1,
                   help="conversations replayed at once on each server (default: 1)")  # fmt: skip
    p.add_argument("--base-url", action="append", default=None, metavar="LABEL=URL",
                   help="measure a server already running under this configuration's label "
                   "instead of starting one (repeatable; replaces --methods)")  # fmt: skip
    p.set_defaults(func=cmd_bench_multiturn)


def cmd_bench_multiturn(args: argparse.Namespace) -> int:
    opts = MultiturnOptions(
        engine=EngineArgs.from_cli_args(args),
        methods=parse_methods(args.methods),
        base_urls=parse_base_urls(args.base_url),
        **flag_values(
            args, "conversations", "num_conversations", "max_turns", "max_tokens",
            "request_timeout", "output_dir", "concurrency",
        ),
    )  # fmt: skip
    return run_multiturn(opts).exit_code
