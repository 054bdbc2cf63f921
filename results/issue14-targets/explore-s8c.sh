#!/bin/bash
# Issue 14, session 8, third exploration: centroidkv-safe-fitted at keep 0.25 (more key steps with
# rounds once / each+once; a 64-query window for guard AND fit, beside its mean twin with the same window).
#   bash results/issue14-targets/explore-s8c.sh [OUTDIR]   (resumable)
set -u
OUT=${1:-results/issue14-targets/explore-s8c}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
V=(--method centroidkv-safe-fitted:merger.rounds=each+once,merger.refine=6
   --method centroidkv-safe-fitted:merger.rounds=once,merger.refine=10
   --method centroidkv-safe:query_window=64
   --method centroidkv-safe-fitted:query_window=64,merger.reference_queries=64
   --method centroidkv-safe-fitted:query_window=64,merger.reference_queries=64,merger.rounds=once)
COMMON=(--budgets 0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full,centroidkv-safe "${V[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full,centroidkv-safe "${V[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
