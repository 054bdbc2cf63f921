"""Session 14 (h16): the A/B of ab_d2o_s14.py interleaved layer by layer (robust to load drift on a
shared machine): per preset, one pipeline per arm prepared from the same 30 states; for every layer,
both arms compress it (order alternating), CPU seconds summed per arm; the compressed states of the two
arms are compared bit for bit (keys, values, log_sizes, positions, counts, extras).
    PYTHONPATH=$PWD:$PWD/tests python benchmarks/results/ab_d2o_s14_layers.py STATES.pt [REPS] [OUT.json] [PRESETS,...]"""
import json, os, statistics, sys, time, torch
torch.set_num_threads(1)
from kvcompress.bench import cost
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import scratch
sys.argv, argv = sys.argv[:1], sys.argv  # ab_d2o_s14 reads argv at import: give it none
import importlib.util
spec = importlib.util.spec_from_file_location("ab", os.path.join(os.path.dirname(__file__), "ab_d2o_s14.py"))
src = open(spec.origin).read().split("states = torch.load")[0]  # its arms only
ab = {}
exec(compile(src, spec.origin, "exec"), ab)
sys.argv = argv
from test_exact_fast_paths import _equal_states

NEW, OLD, use = ab["NEW"], ab["OLD"], ab["use"]
states = torch.load(sys.argv[1], weights_only=False)
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
names = sys.argv[4].split(",") if len(sys.argv) > 4 else ["kvzip-copy-heads", "kvzip-d2o", "d2o", "d2o-prop",
                                                          "kvzip-d2o-median", "kvzip-d2o-tokens"]
out = {"load_start": os.getloadavg(), "presets": {}}
for name in names:
    cfg = get_preset(name, keep_ratio=0.25, on_infeasible="best_effort")
    ins = cost.with_inputs(states, cfg)
    tot = {"new": [], "old": []}
    same = True
    with torch.inference_mode():
        for r in range(reps):
            pipes, t = {}, {"new": 0.0, "old": 0.0}
            for arm in ("new", "old"):
                use(NEW if arm == "new" else OLD)
                pipes[arm] = Pipeline(cfg)
                if r == 0:  # warm-up of layer 0 per arm
                    pipes[arm].prepare(ins); pipes[arm].compress(ins[0], 0); pipes[arm] = Pipeline(cfg)
                c = time.process_time()
                if pipes[arm].needs_all_layers:
                    pipes[arm].prepare(ins)
                t[arm] += time.process_time() - c
            scratch.clear()
            with scratch.compression_round():
                for i, st in enumerate(ins):
                    got = {}
                    for arm in (("new", "old") if (i + r) % 2 == 0 else ("old", "new")):
                        use(NEW if arm == "new" else OLD)
                        c = time.process_time()
                        got[arm] = pipes[arm].compress(st, i)[0]
                        t[arm] += time.process_time() - c
                    same = same and _equal_states(got["new"], got["old"])
            use(NEW)
            for arm in t:
                tot[arm].append(t[arm])
    ratios = [a / b for a, b in zip(tot["new"], tot["old"])]
    out["presets"][name] = {"new_cpu_s": tot["new"], "old_cpu_s": tot["old"], "ratios": ratios,
                            "ratio_median": statistics.median(ratios), "identical_states": same, "load": os.getloadavg()}
    print(name, "new", [round(x, 3) for x in tot["new"]], "old", [round(x, 3) for x in tot["old"]],
          "ratios", [round(x, 3) for x in ratios], "identical", same, os.getloadavg(), flush=True)
json.dump(out, open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/h16/ab_layers.json", "w"), indent=1)
