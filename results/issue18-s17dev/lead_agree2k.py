"""kvzip-copy-heads-lead's agreement (LCS / 64) at 2k keep 0.25 on seeds 0-3, window by window against SnapKV and
banded (the committed runs' cells; the SnapKV rerun beside the lead must equal them: same windows, same summaries).

    python results/issue18-s17dev/lead_agree2k.py
"""

import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).parent
R = HERE.parent
spec = importlib.util.spec_from_file_location("heldout_summary", R / "issue18-heldout" / "summary.py")
heldout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heldout)
COMMITTED = {0: R / "issue18-grid6", 1: R / "issue18-heldout", 2: R / "issue18-seed2", 3: R / "issue18-seed3"}
LEAD, BANDED = "kvzip-copy-heads-lead", "kvzip-copy-heads-banded"


def main():
    lead, snap, band, checked = {}, {}, {}, []
    for seed, root in COMMITTED.items():
        old = heldout.per_window(root, "agreement-2k", "lcs", 0.25)
        new = (heldout.per_window(HERE, f"lead-agree-2k-s{seed}", "lcs", 0.25) if seed != 3 else old)
        for w, v in new.get(LEAD, {}).items():
            if w not in old.get("snapkv", {}):
                continue
            if seed != 3:
                checked.append(abs(new["snapkv"][w] - old["snapkv"][w]) < 1e-9)
            lead[f"s{seed}/{w}"], snap[f"s{seed}/{w}"] = v, old["snapkv"][w]
            band[f"s{seed}/{w}"] = old[BANDED][w]
    out = {"windows": len(lead), "snapkv_rerun_equal": f"{sum(checked)}/{len(checked)}",
           "mean": {LEAD: sum(lead.values()) / len(lead), "snapkv": sum(snap.values()) / len(snap),
                    BANDED: sum(band.values()) / len(band)},
           "lead_vs_snapkv": heldout.paired(lead, snap, True), "lead_vs_banded": heldout.paired(lead, band, True)}
    print(json.dumps(out, indent=1))
    (HERE / "lead_agree2k.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
