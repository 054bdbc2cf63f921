"""Results on disk: one JSON line per finished cell (resumable), a run file, a results JSON.

Layout of an output directory:

    run.json        what the run measures (task, model, data, decoding); a rerun must match it
    cells.jsonl     one record per (sample, method, budget, protocol), appended as each finishes
    results.json    run info, machine, every record of the current grid and the aggregates
    *.png           plots

A rerun with the same ``run.json`` skips the cells already in ``cells.jsonl``; lengths, depths,
samples, methods and budgets can change between runs (the grid grows or shrinks), but a change
of what a cell means (model, haystack, needle kind, decoding) is refused.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from ..validation import require


def cell_key(sample_id: str, label: str, budget: float, protocol: str) -> str:
    return f"{sample_id}|{label}|{budget:g}|{protocol}"


class CellStore:
    """Append-only JSON lines of finished cells, keyed by ``cell_key``."""

    def __init__(self, out_dir: str | Path, signature: dict):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "cells.jsonl"
        run_path = self.dir / "run.json"
        signature = json.loads(json.dumps(signature))
        if run_path.exists():
            old = json.loads(run_path.read_text())
            diff = sorted(k for k in set(old) | set(signature) if old.get(k) != signature.get(k))
            require(not diff, "out", str(self.dir),
                    f"a directory of a run with the same settings (these differ: "
                    f"{', '.join(f'{k}: {old.get(k)!r} -> {signature.get(k)!r}' for k in diff)}); use another --out")
        else:
            _write_atomic(run_path, json.dumps(signature, indent=2) + "\n")
        self.records: dict[str, dict] = {}
        if self.path.exists():
            self._repair_tail()
            for line in self.path.read_text().splitlines():
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a damaged line (not the last one): that cell runs again
                if isinstance(rec, dict) and "key" in rec:
                    self.records[rec["key"]] = rec

    def _repair_tail(self) -> None:
        """Drop a last line cut off by an interrupted write (no final newline), so the next record
        starts on a line of its own; a complete last line that only lacks its newline gets one."""
        with self.path.open("rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            # find the start of the last line
            block, pos = b"", size
            while pos > 0 and b"\n" not in block:
                step = min(4096, pos)
                pos -= step
                f.seek(pos)
                block = f.read(step) + block
            cut = block.rfind(b"\n")
            start = pos + cut + 1 if cut >= 0 else 0
            f.seek(start)
            tail = f.read()
            try:
                json.loads(tail)
                f.seek(size)
                f.write(b"\n")  # a whole record: keep it
            except (json.JSONDecodeError, UnicodeDecodeError):
                f.truncate(start)
            f.flush()
            os.fsync(f.fileno())

    def done(self, key: str) -> bool:
        return key in self.records

    def add(self, record: dict) -> None:
        require("key" in record, "record", sorted(record), "a dict with a 'key'")
        line = json.dumps(record) + "\n"  # serialise first: a bad record writes nothing
        self.records[record["key"]] = record
        with self.path.open("a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def machine_info() -> dict:
    """The machine, described as every kvcompress benchmark describes it."""
    from ..bench.machine import describe_machine

    return describe_machine()


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return None if not xs else sum(xs) / len(xs)


def aggregate(records: list[dict], by=("method", "budget", "protocol")) -> list[dict]:
    """Per group: n, hits, accuracy (mean score), leading digits, achieved keep, budget met."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in by)].append(r)
    out = []
    for key, rs in groups.items():
        row = dict(zip(by, key))
        row.update({
            "n": len(rs),
            "hits": sum(bool(r.get("hit")) for r in rs),
            "accuracy": _mean([r.get("score") for r in rs]),
            "leading_digits": _mean([r.get("leading_digits") for r in rs]),
            "keep_max": max(r["keep_max"] for r in rs) if all("keep_max" in r for r in rs) else None,
            "keep_max_mean": _mean([r.get("keep_max") for r in rs]),
            "keep_mean": _mean([r.get("keep_mean") for r in rs]),
            "budget_met": all(r.get("budget_met", True) for r in rs),
            "budget_met_share": _mean([float(r.get("budget_met", True)) for r in rs]),
            "compress_s": _mean([r.get("compress_s") for r in rs]),
            "decode_s": _mean([r.get("decode_s") for r in rs]),
        })
        for extra in ("kl", "top1", "ppl_full", "ppl", "ppl_delta", "lead", "lcs", "forced_kl",
                      "forced_top1", "forced_lead", "reconstruct_s", "prefill_s"):
            if any(extra in r for r in rs):
                row[extra] = _mean([r.get(extra) for r in rs])
        # where the needle's value went (means over layers and heads, then samples)
        traced = [r["trace"]["value"] for r in rs if isinstance(r.get("trace"), dict) and "value" in r["trace"]]
        if traced:
            for k in ("kept", "alone", "mixed", "size"):
                row[f"value_{k}"] = _mean([t.get(k) for t in traced])
        out.append(row)
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in records))}
    out.sort(key=lambda r: tuple(order.get(r[k], 0) if k == "method" else
                                 (-r[k] if k == "budget" else r[k]) for k in by))
    return out


def write_results(path: str | Path, meta: dict, records: list[dict], extra_groups: dict | None = None) -> dict:
    """results.json: run info, per-sample records, aggregates (and more groupings when given)."""
    data = {"meta": meta, "machine": machine_info(), "aggregate": aggregate(records), "samples": records}
    for name, by in (extra_groups or {}).items():
        data[name] = aggregate(records, by)
    _write_atomic(Path(path), json.dumps(data, indent=1) + "\n")
    return data


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub markdown table of ``rows``."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
