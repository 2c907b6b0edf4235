"""What a benchmark run leaves behind, for ``bench latency`` and ``bench serve`` alike:
environment, results.json, table.md (with the anchors' settings), console output and PNG plots."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.aggregate import OVERALL, REFERENCE_CONCURRENCY

MAX_POSITIONS_IN_TABLE = 8


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str | None:
    """``git describe --always --dirty`` of the checkout specdec is imported from, if any."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=40"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_environment(
    model: str, model_path: str | None, settings: dict[str, Any]
) -> dict[str, Any]:
    import psutil
    import torch

    import specdec
    from specdec import kernels

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
        "cpu_model": cpu_model(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "specdec_version": specdec.__version__,
        "transformers_version": _version("transformers"),
        "llama_cpp_python_version": _version("llama_cpp_python"),
        "native_kernels": kernels.native_isa() if kernels.native_available() else None,
        # what activation_dtype "auto" resolves to for GGUF-quantized weights on this machine
        "int8_activations_fast": kernels.int8_activations_fast(),
        "a8_kernels": kernels.a8_kernels() if kernels.native_available() else None,
        "a8_walk": kernels.a8_walk() if kernels.native_available() else None,
        "git_commit": git_commit(),
        "model": model,
        "model_path": model_path,
        **settings,
    }


def default_output_dir() -> Path:
    return Path("bench_out") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")


def write_outputs(out_dir: Path, payload: dict[str, Any], table: str) -> None:
    """results.json and table.md."""
    write_json(out_dir / "results.json", payload)
    (out_dir / "table.md").write_text(table, encoding="utf-8")


# ---- console -----------------------------------------------------------------------------------
def warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def loud(lines: list[str]) -> None:
    bar = "!" * 78
    warn("\n".join([bar, *(f"!! {line}" for line in lines), bar]))


def print_outcome(out_dir: Path, table: str, errors: list[str], failures: list[str]) -> None:
    """The table, then every errored request and failure, then where the files are."""
    print()
    print(table)
    for line in errors:
        warn(f"error: {line}")
    if failures:
        loud([f"{len(failures)} FAILURE(S):", *failures])
    print(f"results in {out_dir}")


@dataclass
class BenchResult:
    """What a benchmark returns: its exit code, its output folder, results.json's payload and
    the failures (exit code 1)."""

    exit_code: int
    output_dir: Path
    payload: dict[str, Any]
    failures: list[str] = field(default_factory=list)


def outcome(
    out_dir: Path, payload: dict[str, Any], table: str, errors: list[str], failures: list[str]
) -> BenchResult:
    """The outcome printed (``print_outcome``) and returned; exit code 1 on any failure."""
    print_outcome(out_dir, table, errors, failures)
    return BenchResult(1 if failures else 0, out_dir, payload, failures)


# ---- tables ---------------------------------------------------------------------------------
def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def identical_cell(row: dict, reference: str, greedy: bool = True) -> str:
    """Exactness of one summary row: a greedy difference of ours at the reference concurrency
    fails; an anchor's, or one at a higher concurrency (bench serve), only informs."""
    checked = row.get("concurrency", REFERENCE_CONCURRENCY) == REFERENCE_CONCURRENCY
    if row["config"] == reference and checked:
        return "reference"
    n, same = row["num_compared"], row["num_identical"]
    if not greedy or n == 0:
        return "n/a"
    if same == n:
        return f"yes ({same}/{n})"
    if checked and row.get("backend", "specdec") == "specdec":
        return f"**NO ({same}/{n}) FAIL**"
    return f"no ({same}/{n}, informative)"


def _cached_cell(row: dict) -> str:
    if row["backend"] != "specdec":
        return "-"
    cached, prompt = row.get("cached_prompt_tokens", 0), row["prompt_tokens"]
    return f"{cached}/{prompt}" + (f" ({100.0 * cached / prompt:.0f}%)" if prompt else "")


def format_latency_table(rows: list[dict], greedy: bool, reference: str) -> str:
    """bench latency: one row per (config, category), each config's overall row after its
    categories."""
    head = (
        "| config | category | prompts | out tokens | tok/s | speedup | vs own plain | decode tok/s "
        "| TTFT ms | cached prompt tokens | accept len | accept rate | accept rate by position "
        "| identical to plain |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        spec = r["spec_decode"]
        by_pos = "-"
        if spec and spec["acceptance_rate_per_pos"]:
            by_pos = " ".join(
                f"{x:.2f}" for x in spec["acceptance_rate_per_pos"][:MAX_POSITIONS_IN_TABLE]
            )
        own = r["speedup_vs_own_plain"] if r["backend"] != "specdec" else None
        cat = f"**{r['category']}**" if r["category"] == OVERALL else r["category"]
        cells = [
            r["config"],
            cat,
            str(r["num_prompts"]) + (f" ({r['num_errors']} errors)" if r["num_errors"] else ""),
            str(r["output_tokens"]),
            fmt(r["tokens_per_s"], ".1f"),
            fmt(r["speedup"], ".2f", "x"),
            fmt(own, ".2f", "x"),
            fmt(r["decode_tokens_per_s"], ".1f"),
            fmt(r["ttft_ms_mean"], ".0f"),
            _cached_cell(r),
            fmt(spec["mean_acceptance_length"] if spec else None, ".2f"),
            fmt(spec["acceptance_rate"] if spec else None, ".2f"),
            by_pos,
            identical_cell(r, reference, greedy),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_serve_table(summary: list[dict], reference: str) -> str:
    """bench serve: one row per (configuration, concurrency), then notes (requests not sent,
    tokens/s and speedup per round)."""
    head = (
        "| config | concurrency | requests | out tokens | seconds | out tok/s | speedup "
        "| TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | E2E p50 ms | accept len "
        "| identical to plain |"
    )
    lines = [head, "|" + "---|" * 14]
    notes = []
    for s in summary:
        spec = s["spec_decode"]
        requests = str(s["num_requests"])
        if s["num_errors"]:
            requests += f" ({s['num_errors']} errors)"
        if s["num_not_sent"]:
            requests += f" ({s['num_not_sent']} not sent)"
            notes.append(
                f"- `{s['config']}` @ {s['concurrency']}: duration limit reached, "
                f"{s['num_not_sent']} request(s) not sent\n"
            )
        cells = [
            s["config"],
            str(s["concurrency"]),
            requests,
            str(s["output_tokens"]),
            fmt(s["duration_s"], ".2f"),
            fmt(s["output_tokens_per_s"], ".1f"),
            fmt(s["speedup"], ".2f", "x"),
            fmt(s["ttft_ms_p50"], ".0f"),
            fmt(s["ttft_ms_p99"], ".0f"),
            fmt(s["tpot_ms_p50"], ".1f"),
            fmt(s["tpot_ms_p99"], ".1f"),
            fmt(s["e2e_ms_p50"], ".0f"),
            fmt(spec["mean_acceptance_length"] if spec else None, ".2f"),
            identical_cell(s, reference),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        notes.extend(_round_notes(s, reference))
    return "\n".join(lines) + "\n" + ("\n" + "".join(notes) if notes else "")


def _round_notes(s: dict, reference: str) -> list[str]:
    per_round = s.get("round_tokens_per_s") or []
    if len(per_round) < 2:
        return []
    note = f"- `{s['config']}` @ {s['concurrency']}: out tok/s per round " + ", ".join(
        f"{x:.1f}" for x in per_round
    )
    if s.get("round_speedups") and s["config"] != reference:
        speedups = ", ".join(f"{x:.2f}x" for x in s["round_speedups"])
        note += f"; speedup per round {speedups} (median {s['median_round_speedup']:.2f}x)"
    return [note + "\n"]


def anchor_notes(anchors: dict[str, dict[str, Any]], skipped: dict[str, str]) -> str:
    """After a blank line, one markdown line per anchor (library, process environment, the
    settings it ran with) and per skipped configuration; nothing when there are none."""
    lines = []
    for label, info in anchors.items():
        env = info["environment"]
        library = ", ".join(f"{k} {v}" for k, v in info["library"].items())
        policy = env.get("omp_wait_policy")
        omp = "OMP_WAIT_POLICY unset" if policy is None else f"OMP_WAIT_POLICY={policy}"
        if env.get("removed_from_ours"):
            omp += " (ours removed)"
        settings = ", ".join(
            f"{k} {_setting(v)}"
            for k, v in info["settings"].items()
            if k not in ("verbose", "seed")
        )
        lines.append(f"- `{label}`: {library}, own process, {omp}; {settings}\n")
    lines += [f"- skipped `{label}`: {why}\n" for label, why in skipped.items()]
    return "\n" + "".join(lines) if lines else ""


def _setting(value: Any) -> str:
    if isinstance(value, dict):
        inner = ", ".join(f"{k}={v}" for k, v in value.items() if k != "class")
        return f"{value['class']}({inner})" if "class" in value else f"{{{inner}}}"
    return str(value)


# ---- plots ----------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(rows: list[dict], reference: str, path: Path, title: str = "") -> None:
    """Grouped bars: one group per category (overall last), one bar per non-reference config."""
    plt = _pyplot()
    categories = list(dict.fromkeys(r["category"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows if r["config"] != reference))
    index = {(r["config"], r["category"]): r["speedup"] for r in rows}
    fig, ax = plt.subplots(
        figsize=(max(6.0, 1.2 * len(categories) * max(1, len(configs)) ** 0.5 + 2), 4.5)
    )
    width = 0.8 / max(1, len(configs))
    for j, label in enumerate(configs):
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(categories))]
        ys = [index.get((label, c)) or 0.0 for c in categories]
        ax.bar(xs, ys, width=width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, rotation=30, ha="right")
    ax.set_ylabel(f"speedup over {reference} (tokens/s ratio)")
    ax.set_title(title or "Speedup per category")
    if configs:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(rows: list[dict], path: Path, title: str = "") -> None:
    """Acceptance rate by draft position: one panel per category (overall first), a line per config."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    cats = [OVERALL] + [c for c in dict.fromkeys(r["category"] for r in rows) if c != OVERALL]
    spec_rows = [
        r for r in rows if r["spec_decode"] and r["spec_decode"]["acceptance_rate_per_pos"]
    ]
    ncols = min(3, len(cats))
    nrows = (len(cats) + ncols - 1) // ncols
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False, sharey=True
    )
    for ax, cat in zip(axes.flat, cats):
        for r in spec_rows:
            if r["category"] == cat:
                rates = r["spec_decode"]["acceptance_rate_per_pos"]
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=r["config"])
        ax.set_title(cat)
        ax.set_xlabel("draft position")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0.0, 1.05)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(cats) :]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("acceptance rate")
    if spec_rows:
        axes[0][0].legend(fontsize="small")
    else:
        axes[0][0].text(
            0.5, 0.5, "no speculative configurations", ha="center", transform=axes[0][0].transAxes
        )
    fig.suptitle(title or "Acceptance rate by draft position")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
