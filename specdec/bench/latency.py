"""``specdec bench latency``: the same prompts through every configuration, one request at a time.

Each configuration is loaded once, runs one warm-up request on a built-in prompt that is in no
data set (excluded; it leaves nothing behind: the prefix cache and everything the drafter learnt
are emptied after it), then every prompt in order with the same sampling, in one engine: prompts that
repeat earlier ones (the repeated task) or extend them (later turns) reuse their KV from the prefix
cache unless ``--no-enable-prefix-caching``, for every configuration alike; the table says how many
prompt tokens came from it. Our ``plain`` runs first (added when missing) and is the reference for
speedups and, under greedy sampling, for exactness: any speculative output that differs from
plain's is a FAILURE (printed, recorded in results.json, exit code 1).

Anchors (transformers, llama.cpp) run in processes of their own with the user's environment
minus what specdec sets for itself (OMP_WAIT_POLICY); results.json records, per anchor, that
environment as the child saw it, the library versions and the exact settings (``anchors``).
"""

from __future__ import annotations

import gc
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec.bench import aggregate, report
from specdec.bench.args import LATENCY_ENGINE_ARGS, BenchOptions, engine_settings
from specdec.bench.configs import BenchConfig, parse_configs
from specdec.bench.dataset import (
    DEFAULT_CODE_PREFIX,
    WARMUP_PROMPT,
    PromptBuilder,
    warmup_item,
)
from specdec.bench.report import loud, warn
from specdec.bench.runners import (
    AnchorRunner,
    AnchorUnavailable,
    GenParams,
    Runner,
    SpecdecRunner,
    run_item,
)

WARMUP_MAX_TOKENS = 32
DEFAULT_ANCHOR_CTX = 4096


@dataclass
class LatencyOptions(BenchOptions):
    # engine: the engine options (LATENCY_ENGINE_ARGS on the command line)
    temperature: float = 0.0  # sampled requests are seeded with engine.seed
    ignore_eos: bool = False
    chat: bool | None = None  # None: chat when the model has a chat template
    code_prefix: str = DEFAULT_CODE_PREFIX
    output_dir: str | None = None
    plots: bool = True
    progress: bool = True
    # every configuration loaded at once; each prompt runs on all of them in turn, their order
    # rotating: drift of a shared machine hits every configuration alike
    interleave: bool = False
    warmup_prompt: str = WARMUP_PROMPT  # the excluded first request's text (tests vary it)


LatencyResult = report.BenchResult


def _validate_models(configs: list[BenchConfig]) -> None:
    """Fail before any measurement when a draft/assistant model cannot be found."""
    from specdec.model.registry import resolve_model_path

    for c in configs:
        key = "model" if c.backend == "specdec" else "assistant_model"
        if key in c.options:
            resolve_model_path(str(c.options[key]))


class _Run:
    """State of one benchmark run; ``execute`` does the work."""

    def __init__(self, opts: LatencyOptions) -> None:
        from specdec.model.registry import resolve_model_path

        self.opts = opts
        self.configs = parse_configs(opts.configs)
        self.reference = self.configs[0].label
        _validate_models(self.configs)
        self.items = opts.load_items()
        self.model_path = resolve_model_path(opts.engine.model)
        self.params = GenParams(
            opts.max_tokens, opts.temperature, opts.engine.seed, opts.ignore_eos
        )
        self.engine = opts.engine
        self.records: list[dict] = []
        self.config_errors: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.builder: PromptBuilder | None = None
        self.eog: set[int] = set()
        self.anchors: dict[str, dict[str, Any]] = {}  # label -> AnchorRunner.info

    def _make_runner(self, cfg: BenchConfig) -> Runner:
        if cfg.backend == "specdec":
            return SpecdecRunner(cfg, self.engine)
        n_ctx = self.engine.max_model_len or DEFAULT_ANCHOR_CTX
        runner = AnchorRunner(
            cfg, self.model_path, self.eog, n_ctx, self.engine.seed,
            self.engine.enable_prefix_caching,
        )  # fmt: skip
        self.anchors[cfg.label] = runner.info
        return runner

    def _init_builder(self, runner: SpecdecRunner) -> None:
        tok = runner.tokenizer
        chat = self.opts.chat
        if chat is None:
            chat = tok.chat_template is not None
            print(
                f"prompts: {'chat template' if chat else 'raw text (the model has no chat template)'}"
            )
        self.builder = PromptBuilder(tok, chat, self.opts.code_prefix)
        self.eog = set(tok.eog_token_ids)

    def _warm_up(self, runner: Runner) -> None:
        """One excluded request on ``warmup_prompt`` (short output); then the runner forgets it
        (prefix cache, drafter state), so the first measured prompt's figures do not depend
        on it."""
        assert self.builder is not None
        p = self.params
        warm = GenParams(min(WARMUP_MAX_TOKENS, p.max_tokens), p.temperature, p.seed, p.ignore_eos)
        try:
            runner.generate(self.builder.prompt_ids(warmup_item(self.opts.warmup_prompt), []), warm)
        except ValueError as e:  # e.g. max_model_len shorter than the warm-up prompt
            warn(f"warm-up request failed: {e}")
        runner.reset_caches()

    def _open(self, cfg: BenchConfig) -> Runner | None:
        """The configuration's runner, warmed up (None when it is skipped)."""
        try:
            runner = self._make_runner(cfg)
        except AnchorUnavailable as e:
            self.skipped[cfg.label] = str(e)
            print(f"skipped {cfg.label}: {e}")
            return None
        try:
            if self.builder is None:
                self._init_builder(runner)
            self._warm_up(runner)
        except BaseException:
            runner.close()
            raise
        return runner

    def run_config(self, cfg: BenchConfig) -> None:
        runner = self._open(cfg)
        if runner is None:
            return
        try:
            assert self.builder is not None
            bar = tqdm(self.items, desc=cfg.label, unit="prompt", disable=not self.opts.progress)
            tokens = seconds = 0.0
            for item in bar:
                rec = run_item(runner, self.builder, item, self.params, cfg)
                self.records.append(rec)
                tokens += rec["output_tokens"]
                seconds += rec["seconds"]
                if seconds > 0:
                    bar.set_postfix_str(f"{tokens / seconds:.1f} tok/s")
            bar.close()
        finally:
            runner.close()
            del runner
            gc.collect()

    def _report_mismatches_now(self, cfg: BenchConfig) -> None:
        if cfg.is_reference or not self.params.greedy:
            return
        aggregate.compare_to_reference(self.records, self.reference, greedy=True)
        bad = [
            r for r in self.records if r["config"] == cfg.label and r["identical_to_plain"] is False
        ]
        if not bad:
            return
        lines = [f"{r['id']}: first difference at turn {r['first_mismatch']['turn']}, "
                 f"token {r['first_mismatch']['token_index']}" for r in bad]  # fmt: skip
        if cfg.backend == "specdec":
            loud(
                [
                    f"FAILURE: {cfg.label}: greedy output differs from plain on {len(bad)} prompt(s)",
                    *lines,
                ]
            )
        else:
            print(
                f"note: {cfg.label} (anchor) differs from our plain on {len(bad)} prompt(s) (informative)"
            )

    def _crashed(self, cfg: BenchConfig, e: Exception) -> None:
        if cfg.is_reference:
            raise e
        self.config_errors[cfg.label] = f"{type(e).__name__}: {e}"
        loud([f"FAILURE: {cfg.label} crashed: {type(e).__name__}: {e}"])
        traceback.print_exc()

    def execute_interleaved(self) -> None:
        runners: dict[str, Any] = {}
        try:
            for cfg in self.configs:
                try:
                    runner = self._open(cfg)
                except Exception as e:
                    self._crashed(cfg, e)
                    continue
                if runner is not None:
                    runners[cfg.label] = runner
            live = [c for c in self.configs if c.label in runners]
            bar = tqdm(self.items, desc="prompts", unit="prompt", disable=not self.opts.progress)
            for i, item in enumerate(bar):
                shift = i % len(live)
                for cfg in live[shift:] + live[:shift]:
                    if cfg.label in self.config_errors:
                        continue
                    try:
                        assert self.builder is not None
                        rec = run_item(runners[cfg.label], self.builder, item, self.params, cfg)
                    except Exception as e:
                        self._crashed(cfg, e)
                        continue
                    self.records.append(rec)
            bar.close()
        finally:
            for r in runners.values():
                r.close()
            runners.clear()
            gc.collect()
        for cfg in self.configs:
            if cfg.label not in self.config_errors and cfg.label not in self.skipped:
                self._report_mismatches_now(cfg)

    def execute(self) -> None:
        if self.opts.interleave:
            self.execute_interleaved()
            return
        for cfg in self.configs:
            try:
                self.run_config(cfg)
            except Exception as e:
                self._crashed(cfg, e)
                continue
            self._report_mismatches_now(cfg)


def run_latency(opts: LatencyOptions) -> LatencyResult:
    run = _Run(opts)
    out_dir = Path(opts.output_dir) if opts.output_dir else report.default_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    categories = list(dict.fromkeys(it.category for it in run.items))
    print(f"{len(run.items)} prompts ({', '.join(categories)}), {len(run.configs)} configurations, "
          f"max_tokens {opts.max_tokens}, temperature {opts.temperature}; output in {out_dir}")  # fmt: skip
    run.execute()
    greedy = run.params.greedy
    aggregate.compare_to_reference(run.records, run.reference, greedy)
    failures = aggregate.find_failures(run.records, run.reference, run.config_errors)
    ran = [(c.label, c.backend) for c in run.configs if c.label not in run.skipped]
    rows = aggregate.summarize(run.records, ran, run.reference)
    settings = {k: v for k, v in asdict(opts).items() if k not in ("plots", "progress", "engine")}
    settings.update(engine_settings(opts.engine, LATENCY_ENGINE_ARGS))
    settings["chat"] = run.builder.chat if run.builder else opts.chat
    payload = {
        "schema": "specdec.bench.latency/1",
        "environment": report.collect_environment(
            opts.engine.model, str(run.model_path), {"settings": settings}
        ),
        "reference": run.reference,
        "greedy": greedy,
        "configs": [asdict(c) for c in run.configs],
        "anchors": run.anchors,
        "skipped": run.skipped,
        "config_errors": run.config_errors,
        "failures": failures,
        "passed": not failures,
        "summary": rows,
        "records": run.records,
    }
    table = report.format_latency_table(rows, greedy, run.reference)
    table += report.anchor_notes(run.anchors, run.skipped)
    report.write_outputs(out_dir, payload, table)
    if opts.plots:
        title = f"{Path(str(opts.engine.model)).name}, max_tokens {opts.max_tokens}"
        report.plot_speedup(
            rows, run.reference, out_dir / "speedup.png", f"Speedup over plain ({title})"
        )
        report.plot_acceptance(
            rows, out_dir / "acceptance_by_position.png", f"Acceptance by position ({title})"
        )
    errors = [f"{r['config']} / {r['id']} (excluded from the figures): {r['error']}"
              for r in run.records if r["error"]]  # fmt: skip
    return report.outcome(out_dir, payload, table, errors, failures)
