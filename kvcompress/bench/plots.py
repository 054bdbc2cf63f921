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


def _panels(plt, budgets, title):
    fig, axes = plt.subplots(1, len(budgets), figsize=(max(5.5, 4.8 * len(budgets)), 4.4), squeeze=False,
                             sharey=True)
    fig.suptitle(title)
    return fig, axes[0]


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
    for model in dict.fromkeys(r["model"] for r in runs):
        backends = list(dict.fromkeys(r["backend"] for r in runs if r["model"] == model and r["budget"] is not None))
        if not budgets:
            continue
        # ---- TPOT
        fig, axes = _panels(plt, budgets, f"{model}: time per output token (median)")
        for ax, budget in zip(axes, budgets):
            for backend in ["stock-sdpa", *backends]:
                method = "full-stock" if backend == "stock-sdpa" else "full"
                xs, ys = _series(runs, model, None, method, backend, lambda r: r["tpot"]["median_ms"])
                if xs:
                    ax.plot(xs, ys, _STYLES.get(backend, "-"), color="black", marker="o", ms=3,
                            label=f"full ({'stock' if method == 'full-stock' else backend})")
            for p in presets:
                for backend in backends:
                    xs, ys = _series(runs, model, budget, p, backend, lambda r: r["tpot"]["median_ms"])
                    if xs:
                        ax.plot(xs, ys, _STYLES.get(backend, "-"), color=colors[p], marker="o", ms=3,
                                label=f"{p} ({backend})")
            ax.set_title(f"budget {budget}")
            ax.set_xlabel("context tokens")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("ms per token")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{prefix}_tpot_{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        # ---- memory
        fig, axes = _panels(plt, budgets, f"{model}: KV-cache bytes (solid: held, dashed: allocated)\n"
                                         "and decode-step peak RSS over the step's start (dotted)")
        first = backends[0] if backends else None
        for ax, budget in zip(axes, budgets):
            xs, ys = _series(runs, model, None, "full", first, lambda r: r["kv_bytes_full"] / MIB)
            if xs:
                ax.plot(xs, ys, "-", color="black", marker="o", ms=3, label="full KV")
            for p in presets:
                xs, ys = _series(runs, model, budget, p, first, lambda r: r["kv_bytes_held"] / MIB)
                if xs:
                    ax.plot(xs, ys, "-", color=colors[p], marker="o", ms=3, label=f"{p} held")
                xs, ys = _series(runs, model, budget, p, first, lambda r: r["kv_bytes_allocated"] / MIB)
                if xs:
                    ax.plot(xs, ys, "--", color=colors[p], marker="x", ms=3, label=f"{p} allocated")
                xs, ys = _series(runs, model, budget, p, first,
                                 lambda r: (r.get("decode_step_rss") or {}).get("delta", 0) / MIB)
                if xs:
                    ax.plot(xs, ys, ":", color=colors[p], marker=".", ms=3, label=f"{p} step peak RSS")
            ax.set_title(f"budget {budget}")
            ax.set_xlabel("context tokens")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("MiB")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{prefix}_memory_{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
