"""A PNG chart of a plan: stacked memory by component per schedule, the budget, and the predicted speedups."""
from __future__ import annotations

from pathlib import Path

from .devices import GiB


def plot_plan(plan, path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for e in plan.estimates:
        names += [n for n, _ in e.components if n not in names]
    schedules = [e.schedule for e in plan.estimates]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(schedules)
    for name in names:
        heights = [dict(e.components).get(name, 0) / GiB for e in plan.estimates]
        if any(heights):
            ax.bar(schedules, heights, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.axhline(plan.budget / GiB, color="black", linestyle="--", label="budget")
    for i, e in enumerate(plan.estimates):
        ax.annotate(f"{plan.speedup(e.schedule):.2f}x" + ("" if e.fits else "\nOOM"), (i, bottom[i]),
                    ha="center", va="bottom")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylabel("GiB per device")
    ax.set_title(title or plan.device)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
