"""Session 25 (a try cut off before its stop; committed by session 26): keep 0.5 only, PG 2k, 8 windows, question-free.
Seed 21 (never used before): noquery against noquery with every non-guard slot chosen by the reconstruction score
(`clusterer.scorer={"name":"reconstruction"}`). Seed 19 (already spent by session 24, so dev here): the guard's
`fill_share` (commit a01cdec) at 0.25 / 0.5 / 1.0 and 0.5 with uniform head budgets (`fillF.json`, `fill0.5u.json`).
Tables as session 22's (results/issue18-s22/summary.py): means, then window-by-window wins/ties/losses against SnapKV
and kvzip. Usage: python results/issue18-s25/summary.py"""
import importlib.util
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("s22", HERE.parent / "issue18-s22" / "summary.py")
s22 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s22)
s22.HERE = HERE
s22.BASELINES = ("snapkv", "kvzip")
AGREE = ["lcs", "lead", "forced_kl", "forced_top1", "forced_lead"]
s22.TASKS = {
    "agreement, seed 21 (held out)": (["agreement-2k-s21-k0.5"], AGREE),
    "fidelity, seed 21 (held out)": (["fidelity-2k-s21-k0.5"], ["kl", "top1"]),
    "agreement, seed 19 (dev), fill 0.5 / 1.0": (["agreement-2k-s19-k0.5-fill"], AGREE),
    "fidelity, seed 19 (dev), fill 0.5 / 1.0": (["fidelity-2k-s19-k0.5-fill"], ["kl", "top1"]),
}

if __name__ == "__main__":
    s22.main()
    # the second seed-19 run (fill 0.25, fill 0.5 uniform) has kvzip beside it, not SnapKV
    s22.BASELINES = ("kvzip",)
    s22.TASKS = {"agreement, seed 19 (dev), fill 0.25 / 0.5 uniform": (["agreement-2k-s19-k0.5"], AGREE),
                 "fidelity, seed 19 (dev), fill 0.25 / 0.5 uniform": (["fidelity-2k-s19-k0.5"], ["kl", "top1"])}
    s22.main()
