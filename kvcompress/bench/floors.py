"""The efficiency floors of issue 7, checked on one benchmark's runs (all against the full cache
measured in the same run). Each floor: threshold, measured value(s), pass / fail / None (not
measured: the run did not include the model, length or budget it needs).

1. kv_bytes:     held KV bytes (padding slots included) <= 1.05 x budget x full bytes, every
                 compressed run.
2. attention:    decode attention alone, Llama-3-8B-shaped, 32k tokens, budget 0.25: best full
                 path / best compressed path >= 3.
3. tpot:         SmolLM2 at 8k, budget 0.25: TPOT speedup (best full / best compressed, medians)
                 >= 0.9 x the memory-traffic bound (W + KV_full) / (W + KV_compressed).
4. compression:  SmolLM2 at 8k, budget 0.25: pipeline time < 5% of the prefill time.
5. bandwidth:    SmolLM2 at 8k, budget 0.25: the bandwidth floor (weights + KV held, at the
                 bandwidth measured in the same context) over the TPOT >= 0.8 (best backend);
                 plain transformers and the uncompressed kvcompress cache reported beside it.
"""

from __future__ import annotations

from .sources import LLAMA3_SYNTHETIC, SMOLLM2

KV_SLACK = 0.05
ATTENTION_MIN_SPEEDUP = 3.0
ATTENTION_LENGTH = 32768
TPOT_BOUND_SHARE = 0.9
TPOT_LENGTH = 8192
COMPRESSION_MAX_SHARE = 0.05
FLOOR_BUDGET = 0.25
BANDWIDTH_SHARE = 0.8


def _is(x: float | None, y: float) -> bool:
    return x is not None and abs(x - y) < 1e-9


def _best(values) -> float | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def _cells(runs, model, length, budget):
    """{preset: [runs]} of compressed runs, and [full runs], for one (model, length, budget)."""
    here = [r for r in runs if r["model"] == model and r["length"] == length]
    full = [r for r in here if r["method"] in ("full", "full-stock")]
    presets: dict[str, list] = {}
    for r in here:
        if r["method"] not in ("full", "full-stock") and _is(r["budget"], budget):
            presets.setdefault(r["method"], []).append(r)
    return presets, full


def _verdict(items: list[dict]) -> bool | None:
    flags = [i["pass"] for i in items if i.get("pass") is not None]
    return None if not flags else all(flags)


def kv_floor(runs) -> dict:
    seen, items = set(), []
    for r in runs:
        if r["method"] in ("full", "full-stock"):
            continue
        key = (r["model"], r["length"], r["method"], r["budget"])
        if key in seen:
            continue  # every backend decodes the same compressed state
        seen.add(key)
        limit = (1 + KV_SLACK) * r["budget"] * r["kv_bytes_full"]
        items.append({"model": r["model"], "length": r["length"], "preset": r["method"], "budget": r["budget"],
                      "held_over_budget": round(r["kv_bytes_held"] / (r["budget"] * r["kv_bytes_full"]), 4),
                      "allocated_over_budget": round(r["kv_bytes_allocated"] / (r["budget"] * r["kv_bytes_full"]), 4),
                      "held_over_full": round(r["kv_bytes_held"] / r["kv_bytes_full"], 4),
                      "keep_achieved_mean": r.get("keep_mean"), "keep_achieved_max": r.get("keep_max"),
                      "budget_met_by_method": r.get("budget_met"), "pass": r["kv_bytes_held"] <= limit})
    return {"name": "kv_bytes", "rule": f"held KV bytes <= (1 + {KV_SLACK}) x budget x full bytes (padding included)",
            "threshold": 1 + KV_SLACK, "measured_max": max((i["held_over_budget"] for i in items), default=None),
            "pass": _verdict(items), "items": items,
            "note": "held = keys + values + log-sizes of the slots in use (padding slots of shorter heads "
                    "included); allocated also counts spare capacity, positions and statistics (reported, "
                    "not part of the floor); keep_achieved = slots / tokens the method reached (mean and "
                    "max over layers and heads): above the budget where the method cannot go lower"}


def attention_floor(runs) -> dict:
    presets, full = _cells(runs, LLAMA3_SYNTHETIC, ATTENTION_LENGTH, FLOOR_BUDGET)
    items = []
    best_full = _best(r.get("attention", {}).get("min_ms") for r in full)
    for preset, rs in presets.items():
        best = _best(r.get("attention", {}).get("min_ms") for r in rs)
        speedup = None if best_full is None or not best else best_full / best
        items.append({"preset": preset, "full_ms": best_full, "compressed_ms": best,
                      "per_backend_ms": {r["backend"]: r.get("attention", {}).get("min_ms") for r in rs},
                      "speedup": None if speedup is None else round(speedup, 3),
                      "pass": None if speedup is None else speedup >= ATTENTION_MIN_SPEEDUP})
    return {"name": "attention_32k", "rule": f"decode attention alone, {LLAMA3_SYNTHETIC}, {ATTENTION_LENGTH} tokens, "
            f"budget {FLOOR_BUDGET}: best full path / best compressed path >= {ATTENTION_MIN_SPEEDUP}",
            "threshold": ATTENTION_MIN_SPEEDUP, "pass": _verdict(items), "items": items,
            "note": "best of reps over all layers of one decode step; full paths: stock SDPA (no log-sizes) "
                    "and kvcompress sdpa / flex over the uncompressed cache"}


def tpot_floor(runs, weights: dict) -> dict:
    presets, full = _cells(runs, SMOLLM2, TPOT_LENGTH, FLOOR_BUDGET)
    W = weights.get(SMOLLM2)
    items = []
    best_full = _best(r["tpot"]["median_ms"] for r in full)
    kv_full = max((r["kv_bytes_full"] for r in full), default=None)
    for preset, rs in presets.items():
        best = _best(r["tpot"]["median_ms"] for r in rs)
        kv_c = rs[0]["kv_bytes_held"]
        if None in (best_full, best, W, kv_full) or not best:
            items.append({"preset": preset, "pass": None})
            continue
        bound = (W + kv_full) / (W + kv_c)
        speedup = best_full / best
        items.append({"preset": preset, "tpot_full_ms": best_full, "tpot_compressed_ms": best,
                      "per_backend_ms": {r["backend"]: r["tpot"]["median_ms"] for r in rs},
                      "speedup": round(speedup, 4), "bound": round(bound, 4),
                      "share_of_bound": round(speedup / bound, 4), "weights_bytes": W, "kv_full_bytes": kv_full,
                      "kv_compressed_bytes": kv_c, "pass": speedup >= TPOT_BOUND_SHARE * bound})
    return {"name": "tpot_smollm2_8k",
            "rule": f"{SMOLLM2} at {TPOT_LENGTH} tokens, budget {FLOOR_BUDGET}: TPOT speedup "
                    f">= {TPOT_BOUND_SHARE} x (W + KV_full) / (W + KV_compressed)", "threshold": TPOT_BOUND_SHARE,
            "pass": _verdict(items), "items": items,
            "note": "medians of the timed steps; best full = fastest of stock DynamicCache and kvcompress "
                    "uncompressed (sdpa / flex); best compressed = fastest backend"}


def compression_floor(runs, contexts) -> dict:
    prefill = {(c["model"], c["length"]): c.get("prefill_s") for c in contexts}
    items = []
    seen = set()
    for r in runs:
        if r["model"] != SMOLLM2 or r["length"] != TPOT_LENGTH or r["method"] in ("full", "full-stock"):
            continue
        key = (r["method"], r["budget"])
        if key in seen:
            continue
        seen.add(key)
        p = prefill.get((r["model"], r["length"]))
        share = None if not p else r["compress_s"] / p
        floor_cell = _is(r["budget"], FLOOR_BUDGET)
        items.append({"preset": r["method"], "budget": r["budget"], "compress_s": round(r["compress_s"], 3),
                      "prefill_s": None if p is None else round(p, 3),
                      "share": None if share is None else round(share, 4),
                      "pass": None if share is None or not floor_cell else share < COMPRESSION_MAX_SHARE})
        if r.get("reconstruct_s") is not None:  # the model pass, reported apart (a forward by design)
            items[-1]["reconstruct_s"] = round(r["reconstruct_s"], 3)
            items[-1]["reconstruct_share"] = None if not p else round(r["reconstruct_s"] / p, 4)
    return {"name": "compression_overhead_8k", "rule": f"{SMOLLM2} at {TPOT_LENGTH} tokens, budget {FLOOR_BUDGET}: "
            f"compression time < {COMPRESSION_MAX_SHARE:.0%} of prefill time (other budgets reported only)",
            "threshold": COMPRESSION_MAX_SHARE, "pass": _verdict(items), "items": items}


def bandwidth_floor(runs) -> dict:
    presets, full = _cells(runs, SMOLLM2, TPOT_LENGTH, FLOOR_BUDGET)
    items = []

    def share(r):
        return (r.get("bandwidth_floor") or {}).get("share_of_floor")

    for r in full:
        items.append({"method": r["method"], "backend": r["backend"], "share_of_floor": share(r),
                      "tpot_vs_plain": (r.get("tpot_vs_plain") or {}).get("median"), "pass": None})
    for preset, rs in presets.items():
        best = max(rs, key=lambda r: share(r) or 0.0)
        items.append({"method": preset, "backend": best["backend"], "share_of_floor": share(best),
                      "floor_ms": (best.get("bandwidth_floor") or {}).get("floor_ms"),
                      "tpot_ms": best["tpot"]["median_ms"],
                      "tpot_vs_plain": (best.get("tpot_vs_plain") or {}).get("median"),
                      "pass": None if share(best) is None else share(best) >= BANDWIDTH_SHARE})
    return {"name": "bandwidth_smollm2_8k",
            "rule": f"{SMOLLM2} at {TPOT_LENGTH} tokens, budget {FLOOR_BUDGET}: (weights + KV held) / measured "
                    f"bandwidth over the TPOT >= {BANDWIDTH_SHARE} (best backend)",
            "threshold": BANDWIDTH_SHARE, "pass": _verdict(items), "items": items,
            "note": "full-stock (plain transformers, no kvcompress code) and full (kvcompress uncompressed) are "
                    "reported, not judged; tpot_vs_plain = median over rounds of plain step / this step"}


def evaluate(runs: list[dict], contexts: list[dict], weights: dict) -> list[dict]:
    """All five floors; ``weights``: {model: bytes of weights read per token}."""
    return [kv_floor(runs), attention_floor(runs), tpot_floor(runs, weights), compression_floor(runs, contexts),
            bandwidth_floor(runs)]
