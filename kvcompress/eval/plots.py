"""Plots of evaluation records (matplotlib, Agg backend: no display needed).

- ``heatmaps``: accuracy by needle depth (rows) x context length (columns), one panel per method
  and budget, one figure per protocol;
- ``accuracy_vs_budget``: one line per method over the budgets (the full cache as a dashed
  line), one panel per protocol (or per task);
- ``metric_vs_budget``: the same for any numeric field (fidelity's KL, top-1 agreement).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def heatmaps(records: list[dict], path_pattern: str | Path, value: str = "score") -> list[Path]:
    """One PNG per protocol (``path_pattern`` with "{protocol}"): a row of panels per method, a
    column per budget (a method run at one budget only, like "full", sits in the first column).
    Each panel is depth (rows) x context length (columns). Returns the paths written."""
    plt = _plt()
    written = []
    by_protocol = defaultdict(list)
    for r in records:
        by_protocol[r["protocol"]].append(r)
    for protocol, rs in sorted(by_protocol.items()):
        methods = list(dict.fromkeys(r["method"] for r in rs))
        budgets_of = {m: sorted({r["budget"] for r in rs if r["method"] == m}, reverse=True) for m in methods}
        columns = sorted({b for m in methods if len(budgets_of[m]) > 1 for b in budgets_of[m]}, reverse=True) or [None]
        lengths = sorted({r["length"] for r in rs})
        depths = sorted({r["depth"] for r in rs})
        cols, rows = len(columns), len(methods)
        pw, ph = max(2.6, 0.9 * len(lengths) + 1.4), max(2.3, 0.42 * len(depths) + 1.3)
        fig, axes = plt.subplots(rows, cols, figsize=(pw * cols + 1.0, ph * rows + 0.6), squeeze=False,
                                 layout="constrained")
        for ax in axes.flat:
            ax.axis("off")
        im = None
        for i, method in enumerate(methods):
            for budget in budgets_of[method]:
                j = 0 if len(budgets_of[method]) == 1 else columns.index(budget)
                ax = axes[i, j]
                ax.axis("on")
                cell = defaultdict(list)
                for r in rs:
                    if r["method"] == method and r["budget"] == budget:
                        cell[(r["depth"], r["length"])].append(r.get(value))
                grid = [[_mean(cell.get((d, n), [])) for n in lengths] for d in depths]
                im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
                for y, row in enumerate(grid):
                    for x, v in enumerate(row):
                        if not math.isnan(v):
                            ax.text(x, y, f"{v:.2g}", ha="center", va="center", fontsize=7)
                ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
                ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
                met = all(r.get("budget_met", True) for r in rs if r["method"] == method and r["budget"] == budget)
                ax.set_title(f"{method}\nkeep {budget:g}{'' if met else ' (not met)'}", fontsize=8)
                ax.set_xlabel("context tokens", fontsize=7)
                if j == 0:
                    ax.set_ylabel("needle depth", fontsize=7)
        if im is not None:
            fig.colorbar(im, ax=axes, shrink=0.6, label=value)
        fig.suptitle(f"NIAH accuracy, {protocol} protocol", fontsize=10)
        path = Path(str(path_pattern).format(protocol=protocol))
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def summary_heatmap(rows: list[dict], path: str | Path, value: str = "accuracy", title: str = "") -> Path:
    """Methods (rows) x budgets (columns) of aggregate ``value``, one panel per protocol;
    cells say hits/n, and "keep 0.29!" the achieved keep where the method did not meet the budget."""
    plt = _plt()
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    width = 1.2 + (0.9 * len(budgets) + 2.6) * len(protocols)
    fig, axes = plt.subplots(1, len(protocols), figsize=(width, 1.2 + 0.32 * len(methods)), squeeze=False,
                             layout="constrained")
    im = None
    for ax, protocol in zip(axes[0], protocols):
        grid = [[float("nan")] * len(budgets) for _ in methods]
        for r in rows:
            if r["protocol"] != protocol or r.get(value) is None:
                continue
            i, j = methods.index(r["method"]), budgets.index(r["budget"])
            grid[i][j] = r[value]
            label = f"{r['hits']}/{r['n']}" if "hits" in r else f"{r[value]:.3g}"
            if not r.get("budget_met", True) and r.get("keep_max") is not None:
                label += f"\nkeep {r['keep_max']:.2f}!"  # best effort: the budget was not reached
            ax.text(j, i, label, ha="center", va="center", fontsize=7)
        im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(budgets)), [f"{b:g}" for b in budgets], fontsize=7)
        ax.set_yticks(range(len(methods)), methods, fontsize=7)
        ax.set_xlabel("budget (keep ratio)", fontsize=8)
        ax.set_title(f"{title} {protocol}".strip(), fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label=value)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def metric_vs_budget(rows: list[dict], path: str | Path, value: str = "accuracy", panel: str = "protocol",
                     ylabel: str | None = None, title: str = "", ylim=(0.0, 1.05)) -> Path:
    """Lines per method over budgets from aggregate rows (method, budget, ``panel``, ``value``)."""
    plt = _plt()
    panels = list(dict.fromkeys(r[panel] for r in rows)) if panel else [None]
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, p in zip(axes.flat, panels):
        sub = [r for r in rows if panel is None or r[panel] == p]
        methods = list(dict.fromkeys(r["method"] for r in sub))
        for method in methods:
            pts = sorted((r["budget"], r[value], r.get("budget_met", True)) for r in sub
                         if r["method"] == method and r.get(value) is not None)
            if not pts:
                continue
            if method == "full" and len(pts) == 1:
                ax.axhline(pts[0][1], color="k", ls="--", lw=1, label=f"{method}")
                continue
            line, = ax.plot([b for b, _, _ in pts], [v for _, v, _ in pts], marker="o", ms=4, lw=1.2, label=method)
            missed = [(b, v) for b, v, met in pts if not met]
            if missed:  # hollow markers: the budget was not met (best effort kept more)
                ax.plot([b for b, _ in missed], [v for _, v in missed], ls="none", marker="o", ms=9, mfc="none",
                        color=line.get_color())
        ax.set_xlabel("budget (keep ratio)")
        ax.set_ylabel(ylabel or value)
        if ylim is not None:
            ax.set_ylim(*ylim)
        budgets = [r["budget"] for r in sub] or [1.0]
        ax.set_xlim(1.03, max(0.0, min(budgets) - 0.08))  # high budget (little compression) left
        ax.grid(alpha=0.3)
        ax.set_title(f"{title}{'' if p is None else (' ' if title else '') + str(p)}", fontsize=9)
        ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def achieved_vs_accuracy(rows: list[dict], path: str | Path, value: str = "accuracy") -> Path:
    """Accuracy against the achieved keep (mean over layers and heads) per method: the tau sweep."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter([r["keep_mean"]], [r[value]], s=18)
        ax.annotate(r["method"].split(":", 1)[-1], (r["keep_mean"], r[value]), fontsize=6)
    ax.set_xlabel("achieved keep (mean slots / tokens)")
    ax.set_ylabel(value)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
