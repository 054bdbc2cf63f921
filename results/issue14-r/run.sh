#!/bin/bash
# Issue 14: how many window queries the fit needs (live KL, centroidkv-fitted at R = 16 / 32; R = 64
# is the preset row of results/issue14-targets), SmolLM2, one window per haystack. Resumable:
#   bash results/issue14-r/run.sh OUTDIR
set -u
OUT=${1:-results/issue14-r}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
R=(--method 'centroidkv-fitted:merger.reference_queries=16' --method 'centroidkv-fitted:merger.reference_queries=32')
COMMON=(--budgets 0.5,0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full,centroidkv-fitted "${R[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full,centroidkv-fitted "${R[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
