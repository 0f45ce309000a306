"""``relayrl plot RUN_DIR ...``: learning curves of one or several runs, overlaid, as PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (panel title, metric keys tried in order)
PANELS = (
    ("reward", ("rollout/reward",)),
    ("eval accuracy", ("eval/accuracy_mean", "eval/accuracy")),  # mean over samples when n > 1
    ("KL (approx)", ("actor/approx_kl", "actor/kl")),
    ("entropy", ("actor/entropy",)),
    ("throughput (samples/s)", ("perf/samples_per_s",)),
    ("staleness (max)", ("rollout/staleness_max",)),
)


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; is it a relayrl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write one PNG with a panel per metric family; returns its path."""
    runs = {str(d): read_metrics(d) for d in run_dirs}
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
        for name, rows in runs.items():
            for key in keys:
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, marker="." if len(pts) < 30 else None, label=Path(name).name)
                    break
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if not handles:
        for ax in axes.flat:
            handles, labels = ax.get_legend_handles_labels()
            if handles:
                break
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4))
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    out_path = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
