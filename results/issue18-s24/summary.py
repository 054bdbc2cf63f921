"""Session 24's held-out runs (seeds 19-20, question after compression, every method in one run): session 22's
tables (results/issue18-s22/summary.py) over this folder. Usage: python results/issue18-s24/summary.py"""
import importlib.util
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("s22", HERE.parent / "issue18-s22" / "summary.py")
s22 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s22)
s22.HERE = HERE
s22.BASELINES = ("snapkv", "kvzip", "kvzip-copy-heads-aligned")
s22.TASKS = {
    "agreement": (["agreement-2k-s19"], ["lcs", "lead", "forced_kl", "forced_top1", "forced_lead"]),
    "fidelity": (["fidelity-2k-s19"], ["kl", "top1"]),
    "dev fill (seed 13, not held out)": (["dev-fill-2k-s13-k0.5"], ["lcs", "lead", "forced_kl", "forced_top1", "forced_lead"]),
}
s22.FACTS = [f"{t}-2k-s{s}" for s in (19, 20) for t in ("word", "distractors", "number", "aware")
             if (HERE / f"{t}-2k-s{s}" / "cells.jsonl").exists()]

if __name__ == "__main__":
    s22.main()
    s22.facts()
