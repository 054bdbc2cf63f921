"""What the fit can change: per preset and budget, the share of the cache's slots that are merged
clusters (a token count >= 2; only those does the fitted merger touch) against exact slots
(protected, guarded, sinks, recent window, singletons), on the fidelity window of each haystack.

    python results/issue14-targets/composition.py --out results/issue14-targets/composition.json
Same window and snapshot as `kvcompress eval fidelity` (prefix 1000, sample s0).
"""
import argparse, json, os, sys
sys.path.insert(0, ".")
import torch
from kvcompress.hf.loading import load_model
from kvcompress.eval.data import Haystack
from kvcompress.eval.caches import Recorder
from kvcompress.eval.fidelity import fidelity_windows
from kvcompress.eval.reconstruction import copy_for
from kvcompress.presets import get_preset

p = argparse.ArgumentParser()
p.add_argument("--presets", default="centroidkv,centroidkv-safe,semanticache-fixed64,kvzip-csm")
p.add_argument("--budgets", default="0.5,0.25")
p.add_argument("--prefix", type=int, default=1000)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--out", required=True)
a = p.parse_args()
torch.set_num_threads(a.threads)
model, tok = load_model()
out = {"prefix": a.prefix, "rows": [], "command": " ".join(sys.argv)}
for name, hay in (("pg", Haystack.load("/work/shared/data/paul_graham_essays")), ("pydoc", Haystack.load(None))):
    sid, ids = fidelity_windows(tok, hay, a.prefix, 500)[0]
    configs = {(pr, b): get_preset(pr, keep_ratio=b) for pr in a.presets.split(",") for b in map(float, a.budgets.split(","))}
    rec = Recorder.for_configs(model, tok, configs.values(), backend="sdpa")
    try:
        rec.feed(ids[:, :a.prefix])
        snap = rec.snapshot()
    finally:
        rec.close()
    for (pr, b), cfg in configs.items():
        copy = copy_for(model, tok, snap, cfg, chat=False)
        slots = merged = tokens_merged = tokens = 0
        for st in copy.cache.states():
            if st is None:
                continue
            c = st.token_counts()[st.valid]
            slots += c.numel(); merged += int((c >= 2).sum())
            tokens += float(c.sum()); tokens_merged += float(c[c >= 2].sum())
        copy.cache.close()
        row = {"haystack": name, "preset": pr, "budget": b, "slots": slots, "merged_slot_share": merged / slots,
               "token_share_in_merged_slots": tokens_merged / tokens,
               "tokens_per_merged_slot": tokens_merged / max(merged, 1)}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
out["loadavg"] = os.getloadavg()
json.dump(out, open(a.out, "w"), indent=1)
