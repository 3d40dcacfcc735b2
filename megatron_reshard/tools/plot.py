"""Per-rank bytes of one or more simulations as a PNG (matplotlib: the optional extra
``plot``)."""

from __future__ import annotations

from typing import Sequence


def plot_loads(sims: Sequence, path: str) -> None:
    """Bytes each training rank sends and each generation rank receives, one line per
    simulation (planner), with the ideal (mean) dashed."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), constrained_layout=True)
    for ax, attr, n, title in ((axes[0], "train_sent", "train_world", "training rank sends"),
                               (axes[1], "gen_received", "gen_world", "generation rank receives")):
        for s in sims:
            count = getattr(s.parallelism, n)
            values = [getattr(s, attr).get(r, 0) / 2**30 for r in range(count)]
            label = "link-aware planner" if s.link_aware else "default planner"
            line, = ax.plot(range(count), values, label=label, linewidth=1)
            ax.axhline(sum(values) / count, linestyle="--", linewidth=0.8, color=line.get_color())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("rank")
        ax.set_ylabel("GiB per refit")
        ax.set_title(title)
        ax.legend()
    sim = sims[0]
    fig.suptitle(f"{sim.model}: {sim.parallelism.describe()}", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
