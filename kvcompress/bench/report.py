"""Markdown tables of a results document (docs/performance.md pastes them)."""

from __future__ import annotations

MIB = 1024 * 1024


def _fmt(x, digits=1):
    return "–" if x is None else f"{x:.{digits}f}"


def _label(r):
    return "full (stock DynamicCache)" if r["method"] == "full-stock" else (
        "full (kvcompress, uncompressed)" if r["method"] == "full" else f"{r['method']} {r['budget']}")


def tpot_table(results: dict, model: str) -> str:
    runs = [r for r in results["runs"] if r["model"] == model]
    backends = list(dict.fromkeys(r["backend"] for r in runs if r["method"] != "full-stock"))
    lengths = sorted({r["length"] for r in runs})
    head = "| method | " + " | ".join(f"{n} tok {b}" for n in lengths for b in backends) + " |"
    lines = [head, "|---|" + "---:|" * (len(lengths) * len(backends))]
    for label in dict.fromkeys(_label(r) for r in runs):
        cells = []
        for n in lengths:
            for b in backends:
                hit = [r for r in runs if _label(r) == label and r["length"] == n
                       and (r["backend"] == b or r["method"] == "full-stock")]
                shown = hit and _shown(hit[0], b, backends)
                cells.append(_fmt(hit[0]["tpot"]["median_ms"], 0) if shown else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _shown(run, backend, backends) -> bool:
    # the stock cache has one backend: show it under the first column only
    return run["method"] != "full-stock" or backend == backends[0]


def _pass_note(run) -> str:
    """The reconstruction pass of a question-free importance preset, apart from its compression."""
    secs = run.get("reconstruct_s")
    return "" if secs is None else f" (+ {secs:.2f} pass)"


def memory_table(results: dict, model: str) -> str:
    runs = [r for r in results["runs"] if r["model"] == model]
    first = next((r["backend"] for r in runs if r["method"] == "full"), None)
    lines = ["| length | method | KV held MiB | held / full | allocated MiB | allocated / full "
             "| build peak RSS MiB | decode-step peak RSS MiB | compress s | attention ms (sdpa / flex) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        if r["method"] != "full-stock" and r["backend"] != first:
            continue
        att = {x["backend"]: x.get("attention", {}).get("min_ms") for x in runs
               if x["length"] == r["length"] and x["method"] == r["method"] and x["budget"] == r["budget"]}
        att_txt = _fmt(att.get("stock-sdpa"), 1) if r["method"] == "full-stock" else \
            " / ".join(_fmt(att.get(b), 1) for b in ("sdpa", "flex") if b in att)
        lines.append(
            f"| {r['length']} | {_label(r)} | {r['kv_bytes_held'] / MIB:.1f} "
            f"| {r['kv_bytes_held'] / r['kv_bytes_full']:.3f} "
            f"| {r['kv_bytes_allocated'] / MIB:.1f} | {r['kv_bytes_allocated'] / r['kv_bytes_full']:.3f} "
            f"| {_fmt((r.get('build_rss_delta') or 0) / MIB, 0)} "
            f"| {_fmt(r['decode_step_rss'].get('delta', 0) / MIB, 0)} "
            f"| {r['compress_s']:.2f}{_pass_note(r)} | {att_txt} |")
    return "\n".join(lines)


def floors_table(results: dict) -> str:
    lines = ["| floor | rule | result | measured |", "|---|---|---|---|"]
    for f in results["floors"]:
        verdict = {True: "**pass**", False: "**FAIL**", None: "not measured"}[f["pass"]]
        items = f.get("items", [])
        if f["name"] == "kv_bytes":
            bad = [i for i in items if not i["pass"]]
            measured = f"max held/budget {f.get('measured_max')}; failing: " + (
                ", ".join(f"{i['model']} {i['length']} {i['preset']} {i['budget']} ({i['held_over_budget']}"
                          + (f", keep reached {i['keep_achieved_mean']:.3f}"
                             if i.get("keep_achieved_mean") is not None else "") + ")"
                          for i in bad) if bad else "none")
        elif f["name"] == "compression_overhead_8k":
            measured = "; ".join(f"{i['preset']} {i['budget']}: {i['share']:.1%}" for i in items
                                 if i.get("share") is not None)
        elif f["name"].startswith("bandwidth_"):
            measured = "; ".join(f"{i['method']} ({i['backend']}): {i['share_of_floor']:.0%} of the floor, "
                                 f"{i['tpot_vs_plain']}x plain" for i in items if i.get("share_of_floor") is not None)
        else:
            keys = {"attention_32k": ("speedup", "x"), "tpot_smollm2_8k": ("share_of_bound", " of bound")}
            k, unit = keys.get(f["name"], ("speedup", ""))
            measured = "; ".join(f"{i['preset']}: {i.get(k)}{unit}" + (
                f" (speedup {i['speedup']}, bound {i['bound']})" if "bound" in i else "") for i in items)
        lines.append(f"| {f['name']} | {f['rule']} | {verdict} | {measured} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    parts = ["## Floors", "", floors_table(results), ""]
    for model in dict.fromkeys(r["model"] for r in results["runs"]):
        parts += [f"## {model}: TPOT (ms, median)", "", tpot_table(results, model), "",
                  f"## {model}: memory, compression, attention alone", "", memory_table(results, model), ""]
    return "\n".join(parts)
