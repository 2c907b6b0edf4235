"""What a benchmark run leaves behind: environment, results.json, table.md and PNG plots."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from specdec.bench.aggregate import OVERALL

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
        "git_commit": git_commit(),
        "model": model,
        "model_path": model_path,
        **settings,
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")


# ---- table ----------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _identical_cell(row: dict, greedy: bool, reference: str) -> str:
    if row["config"] == reference:
        return "reference"
    if not greedy or row["num_compared"] == 0:
        return "n/a"
    n, same = row["num_compared"], row["num_identical"]
    if same == n:
        return f"yes ({same}/{n})"
    return (
        f"no ({same}/{n}, informative)"
        if row["backend"] != "specdec"
        else f"**NO ({same}/{n}) FAIL**"
    )


def _cached_cell(row: dict) -> str:
    if row["backend"] != "specdec":
        return "-"
    cached, prompt = row.get("cached_prompt_tokens", 0), row["prompt_tokens"]
    return f"{cached}/{prompt}" + (f" ({100.0 * cached / prompt:.0f}%)" if prompt else "")


def format_table(rows: list[dict], greedy: bool, reference: str) -> str:
    """Markdown, one row per (config, category) with the overall row after each config's categories."""
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
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["speedup"], ".2f", "x"),
            _fmt(own, ".2f", "x"),
            _fmt(r["decode_tokens_per_s"], ".1f"),
            _fmt(r["ttft_ms_mean"], ".0f"),
            _cached_cell(r),
            _fmt(spec["mean_acceptance_length"] if spec else None, ".2f"),
            _fmt(spec["acceptance_rate"] if spec else None, ".2f"),
            by_pos,
            _identical_cell(r, greedy, reference),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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
