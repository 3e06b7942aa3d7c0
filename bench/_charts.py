"""Charts of the main comparisons, drawn with matplotlib (the ``bench`` extra)
as PNG files beside ``docs/performance.md`` and embedded in it.

* throughput: each library's processing rate side by side (median, with the
  smallest and largest run as a whisker);
* failover: the distribution (empirical CDF) of every trial's takeover time,
  after SIGKILL and after a graceful stop (the hand-off), all runs pooled;
* cancel: the same for the cancel latencies, where the benchmark keeps them.

A chart is drawn from a section's figures and ``samples`` only: nothing is
measured here. Without matplotlib no chart is drawn and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ._report import Chart, Section

WIDTH, HEIGHT, DPI = 8.0, 4.0, 110


def available() -> str:
    """An empty string if matplotlib can be imported, else why not (one line)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "charts not drawn: matplotlib is not installed (pip install -e '.[bench]')"
    return ""


def draw(sections: Sequence[Section], folder: Path, prefix: str = "bench-") -> None:
    """Draw each section's charts into ``folder`` and list them in
    ``section.charts`` (file names relative to ``folder``). A section with
    nothing to draw gets none. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    folder.mkdir(parents=True, exist_ok=True)
    for s in sections:
        if s.name == "throughput":
            _throughput(s, folder, prefix)
        elif s.samples:
            _distributions(s, folder, prefix)


def _throughput(s: Section, folder: Path, prefix: str) -> None:
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rates = [f for f in s.figures if f.label.endswith(": processing") and f.unit == "tasks/s"]
    rates = [f for f in rates if not math.isnan(f.median)]
    if not rates:
        return
    rates.sort(key=lambda f: f.median)
    labels = [f.label.removesuffix(": processing") for f in rates]
    med = [f.median for f in rates]
    lo = [f.median - f.min for f in rates]
    hi = [f.max - f.median for f in rates]
    colors = ["#1f77b4" if lab.startswith("trio-mesh") else "#9e9e9e" for lab in labels]
    colors = [
        "#d62728" if lab.startswith("Worqr") else c for lab, c in zip(labels, colors, strict=True)
    ]
    fig, ax = plt.subplots(figsize=(WIDTH, 0.5 * len(rates) + 1.4), dpi=DPI)
    y = range(len(rates))
    ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=3, ecolor="#333333")
    ax.set_yticks(list(y), labels)
    for i, f in enumerate(rates):
        ax.text(f.max, i, f"  {f.median:,.0f}", va="center", ha="left", fontsize=8)
    ax.set_xlabel(f"tasks/s (median of {s.runs} runs; whiskers: min and max)")
    ax.set_xlim(0, max(f.max for f in rates) * 1.2)
    # at most 5 ticks: six-digit labels run into each other otherwise
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=5))
    ax.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    ax.set_title(
        "Throughput: no-op tasks, one redis-server, concurrency 10 unless named", fontsize=10
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    name = f"{prefix}throughput.png"
    fig.savefig(folder / name, bbox_inches="tight")
    plt.close(fig)
    s.charts.append(Chart(name, "Throughput of each library, side by side"))


def _distributions(s: Section, folder: Path, prefix: str) -> None:
    import matplotlib.pyplot as plt

    groups = list(s.samples.items())
    fig, axes = plt.subplots(1, len(groups), figsize=(WIDTH, HEIGHT), dpi=DPI, squeeze=False)
    for ax, (label, (unit, values)) in zip(axes[0], groups, strict=True):
        xs = sorted(values)
        if not xs:
            continue
        n = len(xs)
        ys = [(i + 1) / n * 100 for i in range(n)]
        ax.step(xs, ys, where="post", color="#1f77b4")
        if n <= 300:
            ax.plot(xs, ys, "o", markersize=2.5, color="#1f77b4")
        if xs[0] > 0 and xs[-1] / xs[0] > 50:
            ax.set_xscale("log")  # a long tail: every decade readable
        ax.set_title(label, fontsize=10)
        scale = ", log scale" if ax.get_xscale() == "log" else ""
        ax.set_xlabel(f"{unit} ({n:,} values, all runs pooled{scale})")
        ax.set_ylabel("% at most this long")
        ax.set_ylim(0, 101)
        ax.grid(alpha=0.3)
        if s.limits.get(label) is not None:
            limit = s.limits[label]
            ax.axvline(limit, color="#d62728", linestyle="--", linewidth=1)
            ax.text(limit, 3, " target", color="#d62728", fontsize=8)
    fig.suptitle(f"{s.title}: latency distribution", fontsize=11)
    fig.tight_layout()
    name = f"{prefix}{s.name}.png"
    fig.savefig(folder / name, bbox_inches="tight")
    plt.close(fig)
    s.charts.append(Chart(name, f"{s.title}: distribution of every latency measured"))
