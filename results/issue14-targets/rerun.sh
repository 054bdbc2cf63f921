#!/bin/bash
# Issue 14, session 5: the fitted cells again with the fit run once per compression (the rounds'
# composed plan fitted against the original members). The mean-merger and SnapKV cells are kept
# (their code path did not change); the previous fitted cells are in */cells-refit-per-round.jsonl.
#   bash results/issue14-targets/rerun.sh        (from the repository root; resumable)
set -u
export HF_HUB_OFFLINE=1
bash results/issue14-targets/run.sh results/issue14-targets
nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval niah --lengths 2048 --depths 0.1,0.5,0.9 --samples 1 \
    --presets centroidkv,centroidkv-fitted,kvzip-csm,kvzip-csm-fitted --budgets 0.5,0.25 --protocols agnostic \
    --threads 1 --no-progress --no-plots --backend sdpa --out results/issue14-targets/niah-2k
nice -n 5 /work/main/.venv/bin/python results/issue14-targets/composition.py --threads 1 \
    --out results/issue14-targets/composition.json
