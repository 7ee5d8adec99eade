"""PNG plot of `specedge bench` results (matplotlib, Agg backend: no display needed).

One column per category (the suite's four and "all"); top row: decode tokens/s vs k (median, with
the interquartile range over repeats as error bars), one line per mode, the target-only (k = 0)
median as a dashed horizontal line of the same colour; bottom row: acceptance rate vs k (and mean
tokens per target call, over k + 1). Each row has one y-scale, so panels compare at a glance; the
acceptance scale spans the rates measured (not all of 0..1, which would squash them at its top).
The title names the machine's load average at the start and end of the run.
"""

from __future__ import annotations

import os
from pathlib import Path

from .runner import CATEGORIES, MODES, find

COLOURS = {"greedy": "#1f77b4", "sampled": "#d62728"}


def rate_limits(values: list[float]) -> tuple[float, float]:
    """The y-range for rates in 0..1: the span measured with a margin, inside 0..1.05."""
    vals = [v for v in values if v == v]  # NaN: no run
    if not vals:
        return 0.0, 1.05
    lo, hi = min(vals), max(vals)
    pad = max(0.02, 0.1 * (hi - lo))
    return max(0.0, lo - pad), min(1.05, hi + pad)


def load_text(machine: dict) -> str:
    """The 1-minute load average the run started and ended under, for the title."""
    start, end = machine.get("load_avg_start"), machine.get("load_avg_end")
    if not start:
        return "load average unknown"
    text = f"load average {start[0]:.2f}"
    return text + (f" to {end[0]:.2f}" if end else "") + f" on {machine.get('logical_cpus') or '?'} logical CPUs"


def plot_results(results: dict, out: str | os.PathLike, dpi: int = 110) -> Path:
    """Write the plot to `out` (PNG) and return its path."""
    fig = make_figure(results)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return out


def make_figure(results: dict):
    """The matplotlib figure plot_results writes."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    summary = results["summary"]
    cats = [c for c in CATEGORIES if any(r["category"] == c for r in summary)] + ["all"]
    modes = [m for m in MODES if any(r["mode"] == m for r in summary)]
    ks = sorted({r["k"] for r in summary})
    spec_ks = [k for k in ks if k > 0]
    fig, axes = plt.subplots(
        2, len(cats), figsize=(3.6 * len(cats) + 1.0, 7.2), squeeze=False, sharex=True, sharey="row"
    )
    rates: list[float] = []
    for j, cat in enumerate(cats):
        ax, ax2 = axes[0][j], axes[1][j]
        for mode in modes:
            col = COLOURS.get(mode, None)
            base = find(summary, mode, 0, cat)
            if base and base["tokens_per_s"]["median"]:
                ax.axhline(
                    base["tokens_per_s"]["median"], color=col, ls="--", lw=1.2, alpha=0.8, label=f"{mode} target-only"
                )
            xs, ys, lo, hi, acc, mac = [], [], [], [], [], []
            for k in spec_ks:
                r = find(summary, mode, k, cat)
                if r is None or r["tokens_per_s"]["median"] is None:
                    continue
                t = r["tokens_per_s"]
                xs.append(k)
                ys.append(t["median"])
                lo.append(t["median"] - (t["q1"] if t["q1"] is not None else t["median"]))
                hi.append((t["q3"] if t["q3"] is not None else t["median"]) - t["median"])
                acc.append(r["acceptance_rate"] if r["acceptance_rate"] is not None else float("nan"))
                mac.append(r["mean_accepted"] if r["mean_accepted"] is not None else float("nan"))
            rates += acc + [m / (k + 1) for m, k in zip(mac, xs)]
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], color=col, marker="o", ms=4, capsize=3, label=f"{mode} speculative")
                ax2.plot(xs, acc, color=col, marker="o", ms=4, label=f"{mode} acceptance")
                ax2.plot(
                    xs,
                    [m / (k + 1) for m, k in zip(mac, xs)],
                    color=col,
                    marker="x",
                    ms=4,
                    ls=":",
                    label=f"{mode} tokens per call / (k+1)",
                )
        ax.set_title(cat)
        ax.grid(alpha=0.3)
        ax2.grid(alpha=0.3)
        ax2.set_xlabel("k (draft tokens per round)")
        if spec_ks:
            ax2.set_xticks(spec_ks)
        if j == 0:
            ax.set_ylabel("decode tokens/s (median, IQR)")
            ax2.set_ylabel("acceptance rate")
    # each row shares its scale: set once all its panels are drawn
    axes[0][0].set_ylim(bottom=0)
    axes[1][0].set_ylim(*rate_limits(rates))
    handles, labels = [], []
    for ax in (axes[0][0], axes[1][0]):
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    b = results.get("bundle", {})
    cfg = results.get("config", {})
    title = (
        f"specedge bench — {Path(str(b.get('path', ''))).name}: target {b.get('target', {}).get('precision')}, "
        f"draft {b.get('draft', {}).get('kind')} {b.get('draft', {}).get('precision') or ''}, "
        f"{cfg.get('max_new_tokens')} new tokens, threads {cfg.get('threads') or 'default'}\n"
        f"{load_text(results.get('machine', {}))}"
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.93))
    return fig
