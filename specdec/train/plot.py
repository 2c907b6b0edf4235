"""The loss curve and validation acceptance of a training run (``train_log.jsonl``) as a PNG."""

from __future__ import annotations

import json
from pathlib import Path


def plot_log(log: str | Path, out: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=0.8, label="training loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (soft-label cross-entropy)")
    evals = [r for r in rows if "val_accepted" in r]
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r["val_accepted"] for r in evals], "o-",
                 color="tab:red", label="validation: simulated accepted tokens (k=3)")  # fmt: skip
        ax2.set_ylabel("accepted tokens per step", color="tab:red")
        fig.legend(loc="upper right")
    ax.set_title(title or Path(log).parent.name)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
