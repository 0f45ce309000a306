"""``relayrl plot RUN_DIR ...``: learning curves of one or several runs, overlaid, as PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import matplotlib.figure

from relayrl.utils.rollouts import run_names

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (panel title, metric keys tried in order: the first one a run logged with a non-zero value, else the first it logged)
PANELS = (
    ("reward", ("rollout/reward",)),
    ("eval accuracy", ("eval/accuracy_mean", "eval/accuracy")),  # mean over samples when n > 1
    # the KL term's estimate of KL(policy || reference); logged when actor.kl_coef > 0 (see KL_FALLBACK)
    ("KL to reference", ("actor/kl_loss",)),
    ("entropy", ("actor/entropy",)),
    ("throughput (samples/s)", ("perf/samples_per_s",)),
    ("staleness (max)", ("rollout/staleness_max",)),
    ("generator-trainer gap (mean |Δ logprob|)", ("mismatch/abs_diff_mean",)),  # docs/mismatch.md
)


# Without a KL term the panel shows what is there, named for what it is: KL(behaviour || trainer) over the
# trained tokens, the gap between the policy that generated a batch and the one training on it.
KL_FALLBACK = ("generator-trainer gap (behav_kl)", ("actor/behav_kl",))


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; is it a relayrl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figure(run_dirs: list[str | Path]) -> matplotlib.figure.Figure:
    """The learning curves of ``run_dirs`` overlaid: one panel per metric family, one line per run."""
    runs = {label: read_metrics(d) for label, d in zip(run_names([Path(d) for d in run_dirs]), run_dirs, strict=True)}
    fig, axes = plt.subplots(2, (len(PANELS) + 1) // 2, figsize=(18, 7))
    for ax in axes.flat[len(PANELS) :]:
        fig.delaxes(ax)
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=False):
        if title == "KL to reference" and not any(k in r for rows in runs.values() for r in rows for k in keys):
            title, keys = KL_FALLBACK
        for name, rows in runs.items():
            series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
            logged = [k for k in keys if series[k]]
            key = next((k for k in logged if any(y for _, y in series[k])), logged[0] if logged else None)
            if key is not None:
                xs, ys = zip(*series[key], strict=True)
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=name)
                if len(keys) > 1:
                    ax.set_ylabel(key.split("/")[-1])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    legends = (ax.get_legend_handles_labels() for ax in axes.flat)
    handles, labels = next((hl for hl in legends if hl[0]), ([], []))
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4))
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write ``figure(run_dirs)`` as one PNG (default: ``curves.png`` in the first run); returns its path."""
    fig = figure(run_dirs)
    out_path = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
