#!/bin/bash
# Issue 14: NIAH slice (2k, 3 depths, agnostic: the question after the compressed context) and the
# fitting cost against an 8k prefill. Run after run.sh, from the same tree:
#   bash results/issue14-targets/run2.sh OUTROOT   (OUTROOT: the repository's results/)
set -u
OUT=${1:-results}
export HF_HUB_OFFLINE=1
nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval niah --lengths 2048 --depths 0.1,0.5,0.9 --samples 1 \
    --presets centroidkv,centroidkv-fitted,kvzip-csm,kvzip-csm-fitted --budgets 0.5,0.25 --protocols agnostic \
    --threads 1 --no-progress --no-plots --backend sdpa --out $OUT/issue14-targets/niah-2k
nice -n 5 /work/main/.venv/bin/python results/issue14-cost/cost.py --tokens 8192 --presets centroidkv --budgets 0.5,0.25 \
    --repeats 2 --R 64 --out $OUT/issue14-cost/cost-8k-R64.json
