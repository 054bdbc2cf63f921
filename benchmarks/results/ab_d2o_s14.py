"""Session 14 (h16): D2O-family compression, this branch's d2o.py against session 12's search and merger
(tests/slow_reference/d2o_v3.py, verbatim from main ffe1659) and main's eviction.rank_desc, A/B interleaved in one process on one real
SmolLM2 8k snapshot (bench_cost's recorder prefill, saved by /tmp/h16/capture.py), 1 thread.
    PYTHONPATH=$PWD:$PWD/tests python benchmarks/results/ab_d2o_s14.py STATES.pt [REPS] [OUT.json] [PRESETS,...]"""
import json, os, statistics, sys, torch
torch.set_num_threads(1)
from kvcompress.bench import cost
from kvcompress.presets import get_preset
from kvcompress.strategies import d2o
from kvcompress.strategies import eviction
from slow_reference import d2o_v3
from test_exact_fast_paths import _rank_desc_v0  # main's rank_desc, verbatim


def old_search(*args, similarities=True, **kwargs):  # session 12's search has no ``similarities``
    return d2o_v3.most_similar_kept(*args, **kwargs)


NEW = {"most_similar_kept": d2o.most_similar_kept, "call": d2o.D2OMerger.__call__, "rank": eviction.rank_desc}
OLD = {"most_similar_kept": old_search, "call": d2o_v3.D2OMerger.__call__, "rank": _rank_desc_v0}


def use(impl):
    d2o.most_similar_kept = impl["most_similar_kept"]
    d2o.D2OMerger.__call__ = impl["call"]
    eviction.rank_desc = impl["rank"]  # (importance.py imports it from eviction at each call)


states = torch.load(sys.argv[1], weights_only=False)
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
names = sys.argv[4].split(",") if len(sys.argv) > 4 else ["kvzip-copy-heads", "kvzip-d2o", "d2o", "d2o-prop", "kvzip-d2o-median", "kvzip-d2o-tokens"]
out = {"load": [os.getloadavg()], "presets": {}}
for name in names:
    cfg = get_preset(name, keep_ratio=0.25, on_infeasible="best_effort")
    t = {"new": [], "old": []}
    for r in range(reps):
        for which in (("new", "old") if r % 2 == 0 else ("old", "new")):
            use(NEW if which == "new" else OLD)
            t[which].append(cost.compression_seconds(cfg, states)[1])  # CPU seconds
    use(NEW)
    ratios = [a / b for a, b in zip(t["new"], t["old"])]
    out["presets"][name] = {"new_cpu_s": t["new"], "old_cpu_s": t["old"], "ratio_median": statistics.median(ratios),
                            "ratios": ratios}
    print(name, "new", [round(x, 3) for x in t["new"]], "old", [round(x, 3) for x in t["old"]],
          "ratio", round(statistics.median(ratios), 3), os.getloadavg(), flush=True)
    out["load"].append(os.getloadavg())
json.dump(out, open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/h16/ab.json", "w"), indent=1)
