"""``specdec bench serve``: the OpenAI server under concurrent streaming chat clients.

For every configuration a server is started in this process (``BackgroundServer`` on a free
127.0.0.1 port, engine flags as ``specdec serve``; all of them up at once, idle ones sleep), or
``--base-url`` points at one already running (one configuration only). ``--rounds R`` runs every
level R times; within a level the configurations alternate, in an order that rotates each round,
so drift of a shared machine hits them alike (figures pool the rounds; the table lists each
round's tokens/s). For every concurrency level C, C clients (asyncio + httpx)
take conversations from a shared queue until none is left (or ``--duration-limit`` passed): each
turn is one streaming chat completion (temperature 0, ``max_tokens``), and later turns carry the
conversation so far, the model's own replies included (as ``bench latency`` does).

Per request: TTFT (send -> first chunk with a token), TPOT ((end-to-end - TTFT) / (output
tokens - 1), as vLLM's serving benchmark), end-to-end latency, output tokens and prompt tokens
served from the prefix cache (the server's usage), and the server's ``spec_decode`` counters. The
in-process server's prefix cache and its drafter's memory of earlier requests (suffix decoding's
global tree) are emptied after the warm-up and before each level, so every level starts cold
(later turns still reuse their conversation's earlier turns). Per (configuration, concurrency): p50/p99 of TTFT,
TPOT and end-to-end latency, output tokens/s = all output tokens / wall time of the level,
speedup = tokens/s over ``plain``'s at the same concurrency, and the mean acceptance length.

Exactness: every reply is compared with ``plain``'s at concurrency 1 (same prompt id and turn;
text and token count). At concurrency 1 a speculative configuration that differs is a FAILURE
(exit code 1), like ``bench latency``. At higher concurrency differences are reported for
information only: batching changes the float arithmetic.

The clients share the process (and the GIL) with the in-process server; the figures include
that overhead, for every configuration alike.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench import report
from specdec.bench.aggregate import (
    REFERENCE_CONCURRENCY,
    add_exactness_counts,
    add_speedups,
    compare_texts_to_reference,
    find_failures,
    summarize_level,
    tpot,
)
from specdec.bench.anchor_server import (
    LLAMA_CPP_REQUEST_EXTRAS,
    LlamaCppServer,
    ReplyTokenCounter,
)
from specdec.bench.args import (
    SERVE_ENGINE_ARGS,
    BenchOptions,
    add_command,
    add_dataset_args,
    engine_settings,
    flag_values,
    int_csv,
    shared_options,
)
from specdec.bench.configs import PLAIN, BenchConfig, parse_config, parse_configs
from specdec.bench.dataset import (
    DEFAULT_CODE_PREFIX,
    WARMUP_PROMPT,
    BenchItem,
    PromptBuilder,
    warmup_item,
)
from specdec.bench.latency import DEFAULT_ANCHOR_CTX
from specdec.bench.report import fmt, loud, warn
from specdec.bench.runners import AnchorUnavailable
from specdec.config import ConfigError, EngineArgs

SCHEMA = "specdec.bench.serve/1"
DEFAULT_CONCURRENCY = (1, 4, 16)
WARMUP_MAX_TOKENS = 16
MAX_ERROR_CHARS = 300


@dataclass
class ServeOptions(BenchOptions):
    # engine: the engine options (SERVE_ENGINE_ARGS on the command line, where --max-num-seqs
    # defaults to the highest concurrency); ignored with base_url
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    duration_limit: float | None = None  # seconds per (configuration, concurrency) level
    base_url: str | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    code_prefix: str = DEFAULT_CODE_PREFIX
    request_timeout: float = 600.0
    rounds: int = 1  # every level of every configuration once per round, interleaved
    output_dir: str | None = None
    warmup_prompt: str = WARMUP_PROMPT  # the excluded first request's text (tests vary it)


ServeResult = report.BenchResult


# ---- the clients --------------------------------------------------------------------------------
@dataclass
class RequestStyle:
    """What a server needs from the clients beyond the OpenAI API: extra body fields, and a
    token counter when it streams no usage (llama.cpp's)."""

    extra_body: dict[str, Any] = field(default_factory=dict)
    counter: ReplyTokenCounter | None = None


def _error_text(body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    return str(message)[:MAX_ERROR_CHARS]


@dataclass
class _ChatStream:
    """What a chat completion's stream has said so far."""

    parts: list[str] = field(default_factory=list)
    ttft: float | None = None
    usage: dict | None = None
    spec: dict | None = None
    finish: str | None = None
    error: str | None = None

    def take(self, data: str, since_start: float) -> None:
        """One ``data:`` event (not ``[DONE]``), ``since_start`` s after the request was sent."""
        event = json.loads(data)
        if "error" in event:
            self.error = _error_text(data)
            return
        text = ""
        for choice in event.get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or ""
            self.finish = choice.get("finish_reason") or self.finish
        self.parts.append(text)
        if event.get("usage"):
            self.usage = event["usage"]
        if event.get("spec_decode"):
            self.spec = event["spec_decode"]
        got_token = text or (self.usage and self.usage.get("completion_tokens", 0) > 0)
        if self.ttft is None and got_token:
            self.ttft = since_start

    def record(self, start: float, e2e: float) -> dict:
        """The partial record ``stream_chat`` returns."""
        usage = self.usage
        output_tokens = int(usage["completion_tokens"]) if usage else 0
        return {
            "prompt_tokens": int(usage["prompt_tokens"]) if usage else 0,
            "cached_prompt_tokens": int(
                ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            ),
            "output_tokens": output_tokens,
            "ttft_s": self.ttft,
            "tpot_s": tpot(e2e, self.ttft, output_tokens),
            "e2e_s": e2e,
            "start_perf": start,
            "finish_reason": self.finish,
            "text": "".join(self.parts),
            "spec_decode": self.spec,
            "error": self.error,
        }


def _chat_body(
    model: str,
    messages: list[dict],
    max_tokens: int,
    ignore_eos: bool,
    style: RequestStyle | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if style is not None:
        body.update(style.extra_body)
    return body


async def stream_chat(
    client: Any,
    base_url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    ignore_eos: bool,
    style: RequestStyle | None = None,
) -> dict:
    """One streaming chat completion, timed; a partial record (no id/config fields)."""
    import httpx

    body = _chat_body(model, messages, max_tokens, ignore_eos, style)
    got = _ChatStream()
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                got.error = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    got.take(data, time.perf_counter() - start)
    except (httpx.HTTPError, ValueError) as e:
        got.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
    end = time.perf_counter()
    if got.error is None and got.usage is None and style is not None and style.counter is not None:
        got.usage = style.counter.usage(messages, "".join(got.parts), got.finish)
    if got.error is None and got.usage is None:
        got.error = "the stream carried no usage (stream_options.include_usage unsupported?)"
    return got.record(start, end - start)


@dataclass
class _Level:
    rows: list[dict]
    duration_s: float
    num_clients: int
    num_not_sent: int


async def run_level(
    base_url: str,
    model: str,
    items: list[BenchItem],
    builder: PromptBuilder,
    concurrency: int,
    max_tokens: int,
    ignore_eos: bool = False,
    duration_limit: float | None = None,
    request_timeout: float = 600.0,
    api_key: str | None = None,
    style: RequestStyle | None = None,
) -> _Level:
    """``concurrency`` closed-loop clients over the conversations; every turn is one request."""
    import httpx

    queue: asyncio.Queue[BenchItem] = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    rows: list[dict] = []
    not_sent = 0
    start = time.perf_counter()
    deadline = None if duration_limit is None else start + duration_limit

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal not_sent
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            messages: list[dict] = []
            for turn in range(len(item.turns)):
                if deadline is not None and time.perf_counter() >= deadline:
                    not_sent += len(item.turns) - turn
                    break
                messages.append({"role": "user", "content": builder.user_text(item, turn)})
                row = await stream_chat(
                    client, base_url, model, messages, max_tokens, ignore_eos, style
                )
                row["start_s"] = row.pop("start_perf") - start
                rows.append({"id": item.id, "category": item.category, "turn": turn, **row})
                if row["error"]:
                    not_sent += len(item.turns) - turn - 1
                    break
                messages.append({"role": "assistant", "content": row["text"]})

    num_clients = min(concurrency, len(items))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    timeout = httpx.Timeout(request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(num_clients)))
    duration = time.perf_counter() - start
    rows.sort(key=lambda r: r["start_s"])
    return _Level(rows, duration, num_clients, not_sent)


def served_model_name(base_url: str, api_key: str | None = None) -> str:
    """The first model ``GET /v1/models`` lists."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# ---- the run -----------------------------------------------------------------------------------
class InProcessServer:
    """The engine behind ``specdec serve``, with one configuration, on a free 127.0.0.1 port
    (``max_num_seqs`` where the engine options leave it unset)."""

    def __init__(
        self, engine: EngineArgs, cfg: BenchConfig, model_path: Path, max_num_seqs: int
    ) -> None:
        from specdec.engine.async_llm import AsyncLLM
        from specdec.entrypoints.openai.api_server import BackgroundServer, build_app
        from specdec.llm import LLM

        llm = LLM.from_engine_args(
            engine.replace(
                speculative_config=cfg.speculative_config(),
                max_num_seqs=engine.max_num_seqs or max_num_seqs,
            )
        )
        self.name = engine.model
        self.llm = AsyncLLM(llm.engine, log_stats=False)
        app = build_app(self.llm, [self.name], model_root=str(model_path))
        self.server = BackgroundServer(app).start(timeout=120.0)

    def reset_caches(self) -> None:
        """The prefix cache and the drafter's memory of earlier requests: a cold level."""

        def reset(engine) -> None:
            engine.reset_prefix_cache()
            engine.reset_drafter_cache()

        asyncio.run(self.llm.call(reset))

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.server = None  # type: ignore[assignment]


class _Run:
    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.levels = sorted(set(opts.concurrency))
        if opts.base_url:
            if len(opts.configs) != 1:
                raise ConfigError(
                    "--base-url measures one running server: give one --configs label"
                )
            self.configs = [parse_config(opts.configs[0])]
        else:
            self.configs = parse_configs(opts.configs)
        for c in self.configs:
            if c.is_anchor and (opts.base_url or (c.backend, c.method) != ("llama_cpp", PLAIN)):
                raise ConfigError(
                    f"bench serve measures our server and llama.cpp's (llama_cpp:plain, not with "
                    f"--base-url), not {c.label} (see bench latency)"
                )
        self.reference = PLAIN
        self.items = opts.load_items()
        self.model_path: Path | None = None
        if not opts.base_url:
            from specdec.bench.latency import _validate_models
            from specdec.model.registry import resolve_model_path

            _validate_models(self.configs)
            self.model_path = resolve_model_path(opts.engine.model)
        # NOTE: chat completions: the server applies the template; turns are user messages.
        self.builder = PromptBuilder(None, chat=True, code_prefix=opts.code_prefix)
        self.records: list[dict] = []
        self.summary: list[dict] = []
        self.config_errors: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.anchors: dict[str, dict[str, Any]] = {}  # label -> LlamaCppServer.info
        self.out_dir = Path(".")  # where the llama.cpp server writes its log

    def _warm_up(self, t: _Target) -> None:
        """One excluded request on ``warmup_prompt``; an in-process server forgets it before the
        first level (``reset_caches``)."""
        messages = [{"role": "user", "content": warmup_item(self.opts.warmup_prompt).turns[0]}]

        async def once() -> dict:
            import httpx

            async with httpx.AsyncClient(timeout=self.opts.request_timeout) as client:
                max_tokens = min(WARMUP_MAX_TOKENS, self.opts.max_tokens)
                return await stream_chat(
                    client, t.url, t.model, messages, max_tokens, False, t.style
                )

        row = asyncio.run(once())
        if row["error"]:
            warn(f"warm-up request failed: {row['error']}")

    def _measure_level(self, t: _Target, c: int) -> _Level:
        cfg = t.cfg
        if t.server is not None:
            t.server.reset_caches()
        level = asyncio.run(
            run_level(
                t.url, t.model, self.items, self.builder, c, self.opts.max_tokens,
                self.opts.ignore_eos, self.opts.duration_limit, self.opts.request_timeout,
                self.opts.api_key, t.style,
            )
        )  # fmt: skip
        for r in level.rows:
            r.update(config=cfg.label, concurrency=c, backend=cfg.backend)
            if cfg.is_plain:
                r["spec_decode"] = None  # the server reports zero counters for plain
        self.records.extend(level.rows)
        s = summarize_level(level.rows, level.duration_s)
        print(
            f"{cfg.label} @ {c}: {s['num_requests']} requests"
            + (f" ({s['num_errors']} errors)" if s["num_errors"] else "")
            + f", {fmt(s['output_tokens_per_s'], '.1f')} tok/s, TTFT p50 "
            f"{fmt(s['ttft_ms_p50'], '.0f')} ms, TPOT p50 {fmt(s['tpot_ms_p50'], '.1f')} ms, "
            f"prompt tokens from the prefix cache {s['cached_prompt_tokens']}/{s['prompt_tokens']}",
            flush=True,
        )
        return level

    def _start(self, targets: list[_Target]) -> None:
        """One server per configuration (or the one at --base-url), each warmed up; appended to
        ``targets`` as they start, so the caller stops them whatever happens."""
        if self.opts.base_url:
            url = self.opts.base_url.rstrip("/")
            target = _Target(self.configs[0], url, served_model_name(url, self.opts.api_key))
            targets.append(target)
            self._warm_up(target)
            return
        assert self.model_path is not None
        for cfg in self.configs:
            try:
                if cfg.is_anchor:
                    target = self._start_llama_cpp(cfg, self.model_path)
                else:
                    server = InProcessServer(
                        self.opts.engine, cfg, self.model_path, max(self.opts.concurrency)
                    )
                    target = _Target(cfg, server.url, server.name, server)
                if target is None:
                    continue
                targets.append(target)
                self._warm_up(target)
            except Exception as e:
                self._crashed(cfg, e)

    def _start_llama_cpp(self, cfg: BenchConfig, model_path: Path) -> _Target | None:
        """llama.cpp's server in its own process (None when it is skipped)."""
        n_ctx = self.opts.engine.max_model_len or DEFAULT_ANCHOR_CTX
        log = self.out_dir / "llama_cpp_server.log"
        try:
            counter = ReplyTokenCounter(model_path)
            server = LlamaCppServer(model_path, n_ctx, self.opts.engine.seed, log)
        except AnchorUnavailable as e:
            self.skipped[cfg.label] = str(e)
            print(f"skipped {cfg.label}: {e}")
            return None
        extra = dict(LLAMA_CPP_REQUEST_EXTRAS)
        if self.opts.ignore_eos:
            extra["min_tokens"] = self.opts.max_tokens
        self.anchors[cfg.label] = server.info
        self.anchors[cfg.label]["settings"]["request"] = extra
        try:
            model = served_model_name(server.url)
        except BaseException:
            server.stop()
            raise
        return _Target(cfg, server.url, model, server, RequestStyle(extra, counter))

    def _crashed(self, cfg: BenchConfig, e: Exception) -> None:
        if cfg.is_reference or self.opts.base_url:
            raise e
        self.config_errors[cfg.label] = f"{type(e).__name__}: {e}"
        loud([f"FAILURE: {cfg.label} crashed: {type(e).__name__}: {e}"])
        traceback.print_exc()

    def execute(self) -> None:
        """Every round runs every level of every configuration once. Configurations alternate
        within a level (their order rotates each round), so a machine that drifts (other load,
        clocks) shifts them alike; each in-process server's caches are emptied first, so
        every level starts cold."""
        targets: list[_Target] = []
        levels: dict[tuple[str, int], list[_Level]] = {}
        try:
            self._start(targets)
            for rnd in range(self.opts.rounds):
                for c in self.levels:
                    shift = rnd % max(1, len(targets))
                    for t in targets[shift:] + targets[:shift]:
                        if t.cfg.label in self.config_errors:
                            continue
                        try:
                            level = self._measure_level(t, c)
                        except Exception as e:
                            self._crashed(t.cfg, e)
                            continue
                        levels.setdefault((t.cfg.label, c), []).append(level)
        finally:
            for t in targets:
                if t.server is not None:
                    t.server.stop()
            targets.clear()
            gc.collect()
        for cfg in self.configs:
            for c in self.levels:
                runs = levels.get((cfg.label, c))
                if not runs:
                    continue
                s = {
                    "config": cfg.label,
                    "backend": cfg.backend,
                    "concurrency": c,
                    "rounds": len(runs),
                    "num_clients": runs[0].num_clients,
                    "num_not_sent": sum(lv.num_not_sent for lv in runs),
                    **summarize_level(
                        [r for lv in runs for r in lv.rows], sum(lv.duration_s for lv in runs)
                    ),
                    "round_tokens_per_s": [
                        sum(r["output_tokens"] for r in lv.rows if not r["error"]) / lv.duration_s
                        for lv in runs
                    ],
                }
                self.summary.append(s)
                if runs[0].num_clients < c:
                    print(
                        f"  note: only {len(self.items)} conversations, so {runs[0].num_clients} "
                        f"clients at concurrency {c}"
                    )


@dataclass
class _Target:
    cfg: BenchConfig
    url: str
    model: str
    server: InProcessServer | LlamaCppServer | None = None  # None: --base-url, not ours to reset
    style: RequestStyle | None = None


def run_serve(opts: ServeOptions) -> ServeResult:
    if opts.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if opts.num_prompts is not None and opts.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if not opts.concurrency or min(opts.concurrency) < 1:
        raise ValueError("--concurrency must be positive integers")
    if opts.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if opts.duration_limit is not None and opts.duration_limit <= 0:
        raise ValueError("--duration-limit must be > 0 seconds")
    run = _Run(opts)
    out_dir = Path(opts.output_dir) if opts.output_dir else report.default_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    run.out_dir = out_dir
    n_requests = sum(len(it.turns) for it in run.items)
    where = opts.base_url or "a server per configuration"
    print(f"{len(run.items)} conversations ({n_requests} requests), {len(run.configs)} "
          f"configurations x concurrency {','.join(map(str, run.levels))}, max_tokens "
          f"{opts.max_tokens}, against {where}; output in {out_dir}")  # fmt: skip
    if REFERENCE_CONCURRENCY not in run.levels:
        warn("note: no concurrency 1, so greedy outputs are not checked against plain")
    run.execute()
    compare_texts_to_reference(run.records, run.reference)
    add_exactness_counts(run.summary, run.records)
    add_speedups(run.summary, run.reference)
    failures = find_failures(run.records, run.reference, run.config_errors)
    settings = asdict(opts)
    settings.pop("api_key")
    settings.pop("engine")
    settings.update(engine_settings(opts.engine, SERVE_ENGINE_ARGS))
    settings["concurrency"] = run.levels
    payload = {
        "schema": SCHEMA,
        "environment": report.collect_environment(
            opts.engine.model,
            str(run.model_path) if run.model_path else None,
            {"settings": settings},
        ),
        "reference": run.reference,
        "reference_concurrency": REFERENCE_CONCURRENCY,
        "greedy": True,
        "configs": [asdict(c) for c in run.configs],
        "concurrency": run.levels,
        "anchors": run.anchors,
        "skipped": run.skipped,
        "config_errors": run.config_errors,
        "failures": failures,
        "passed": not failures,
        "summary": run.summary,
        "records": run.records,
    }
    table = report.format_serve_table(run.summary, run.reference)
    table += report.anchor_notes(run.anchors, run.skipped)
    report.write_outputs(out_dir, payload, table)
    errors = [f"{r['config']} @ {r['concurrency']} / {r['id']} turn {r['turn']}: {r['error']}"
              for r in run.records if r["error"]]  # fmt: skip
    return report.outcome(out_dir, payload, table, errors, failures)


# ---- the command ---------------------------------------------------------------------------------
SERVE_EPILOG = """\
Each configuration ([method][:key=value,...], as bench latency) gets its own in-process server;
llama_cpp:plain starts llama-cpp-python's server (pip install 'llama-cpp-python[server]') in its
own process, with our environment minus OMP_WAIT_POLICY (its replies are compared for
information only, and their tokens counted here: it streams no usage). With --base-url, the one
running server is measured under the single --configs label given. Concurrency 1 replies that
differ from plain's are a FAILURE (exit code 1).

example:
  specdec bench serve --model smollm2-135m --dataset ../shared/bench/data/mt_bench.jsonl \\
      --num-prompts 8 --max-tokens 128 --concurrency 1,4 --configs plain ngram:k=5
"""


def add_serve_parser(sub) -> None:
    p = add_command(
        sub,
        "serve",
        "the OpenAI server under concurrent streaming clients: TTFT, TPOT, tokens/s",
        SERVE_EPILOG,
    )
    EngineArgs.add_cli_args(p, SERVE_ENGINE_ARGS, defaults={"max_num_seqs": None})
    add_dataset_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int_csv, default=DEFAULT_CONCURRENCY,
                   help="comma-separated client counts (default: 1,4,16)")  # fmt: skip
    p.add_argument("--configs", nargs="+", default=["plain", "ngram:k=5"], metavar="CONFIG",
                   help="configurations to compare (default: plain ngram:k=5)")  # fmt: skip
    p.add_argument("--duration-limit", type=float, default=None, metavar="S",
                   help="per configuration and concurrency: send no new request after S seconds")  # fmt: skip
    p.add_argument("--base-url", default=None,
                   help="measure this running server (http://HOST:PORT) instead of starting one")  # fmt: skip
    p.add_argument("--api-key", default=None, help="with --base-url: sent as a Bearer token")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--code-prefix", default=DEFAULT_CODE_PREFIX,
                   help="put this before code_completion prompts (default: %(default)r)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every level of every configuration this many times, configurations "
                   "alternating (figures pool the rounds)")  # fmt: skip
    p.add_argument("--output-dir", default=None, help="default: bench_out/<timestamp>")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    opts = ServeOptions(
        **shared_options(args),
        concurrency=tuple(args.concurrency),
        **flag_values(
            args, "duration_limit", "base_url", "api_key", "ignore_eos", "code_prefix",
            "request_timeout", "rounds", "output_dir",
        ),
    )  # fmt: skip
    return run_serve(opts).exit_code
