"""Dev variants of the copy-head split (results/issue18-dev4/run-dev.sh): kvzip-hybrid's guard with
the sentences only in the highest-copy-score share c of the (layer, KV head) pairs, the other heads
keeping their own best tokens by reconstruction score (share o), SnapKV's choice + D2O the rest."""
import json
import sys

from kvcompress.presets.importance import SURPRISAL_WEIGHT, _d2o, importance_guard

out = sys.argv[1]
for s, t, c, o in [(0.8, 0.15, 0.25, 0.5), (0.8, 0.15, 0.1, 0.5), (0.8, 0.15, 0.5, 0.5),  # round 1
                   (0.8, 0.15, 0.05, 0.5)]:  # round 2
    name = f"copy-s{s}-t{t}-c{c}-o{o}"
    cfg = _d2o(name, importance_guard(s, reduce="median", surprisal=SURPRISAL_WEIGHT, token_share=t,
                                      head_budget="adaptive", copy_heads=c, other_token_share=o))
    json.dump(cfg.to_dict(), open(f"{out}/{name}.json", "w"), indent=1)
    print(name)
