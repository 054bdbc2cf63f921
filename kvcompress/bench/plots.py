"""Plots of a results document: TPOT and memory against context length, one panel per budget."""

from __future__ import annotations

from pathlib import Path

MIB = 1024 * 1024
_STYLES = {"sdpa": "-", "flex": "--", "stock-sdpa": ":"}


def _series(runs, model, budget, method, backend, value):
    pts = sorted((r["length"], value(r)) for r in runs
                 if r["model"] == model and r["method"] == method and r["backend"] == backend
                 and (budget is None or (r["budget"] is not None and abs(r["budget"] - budget) < 1e-9)))
    pts = [(x, y) for x, y in pts if y is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure(plt, budgets, title: str, ylabel: str, draw, path: Path) -> Path:
    """One panel per budget, ``draw(ax, budget)`` filling each; saved to ``path``."""
    fig, axes = plt.subplots(1, len(budgets), figsize=(max(5.5, 4.8 * len(budgets)), 4.4), squeeze=False,
                             sharey=True)
    fig.suptitle(title)
    axes = axes[0]
    for ax, budget in zip(axes, budgets):
        draw(ax, budget)
        ax.set_title(f"budget {budget}")
        ax.set_xlabel("context tokens")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(results: dict, out_dir: Path, prefix: str = "efficiency") -> list[Path]:
    """Write {prefix}_tpot_{model}.png and {prefix}_memory_{model}.png; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]
    written = []
    budgets = sorted({r["budget"] for r in runs if r["budget"] is not None}, reverse=True)
    presets = list(dict.fromkeys(r["method"] for r in runs if r["budget"] is not None))
    colors = {p: f"C{i}" for i, p in enumerate(presets)}
    if not budgets:
        return written
    for model in dict.fromkeys(r["model"] for r in runs):
        backends = list(dict.fromkeys(r["backend"] for r in runs if r["model"] == model and r["budget"] is not None))
        first = backends[0] if backends else None

        def line(ax, budget, method, backend, value, style, color, marker, label):
            xs, ys = _series(runs, model, budget, method, backend, value)
            if xs:
                ax.plot(xs, ys, style, color=color, marker=marker, ms=3, label=label)

        def tpot(ax, budget):
            ms = lambda r: r["tpot"]["median_ms"]  # noqa: E731
            for backend in ["stock-sdpa", *backends]:
                method = "full-stock" if backend == "stock-sdpa" else "full"
                line(ax, None, method, backend, ms, _STYLES.get(backend, "-"), "black", "o",
                     f"full ({'stock' if method == 'full-stock' else backend})")
            for p in presets:
                for backend in backends:
                    line(ax, budget, p, backend, ms, _STYLES.get(backend, "-"), colors[p], "o", f"{p} ({backend})")

        def memory(ax, budget):
            line(ax, None, "full", first, lambda r: r["kv_bytes_full"] / MIB, "-", "black", "o", "full KV")
            for p in presets:
                line(ax, budget, p, first, lambda r: r["kv_bytes_held"] / MIB, "-", colors[p], "o", f"{p} held")
                line(ax, budget, p, first, lambda r: r["kv_bytes_allocated"] / MIB, "--", colors[p], "x",
                     f"{p} allocated")
                line(ax, budget, p, first, lambda r: (r.get("decode_step_rss") or {}).get("delta", 0) / MIB,
                     ":", colors[p], ".", f"{p} step peak RSS")

        written.append(_figure(plt, budgets, f"{model}: time per output token (median)", "ms per token", tpot,
                               out_dir / f"{prefix}_tpot_{model}.png"))
        written.append(_figure(plt, budgets, f"{model}: KV-cache bytes (solid: held, dashed: allocated)\n"
                                             "and decode-step peak RSS over the step's start (dotted)", "MiB",
                               memory, out_dir / f"{prefix}_memory_{model}.png"))
    return written
