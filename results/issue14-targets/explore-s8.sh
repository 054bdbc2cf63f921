#!/bin/bash
# Issue 14, session 8: which settings of the two guarded fitted presets cut KL at keep 0.25 (exploration,
# not the final table): rounds, refine steps, R, query sources, beside the mean twins.
#   bash results/issue14-targets/explore-s8.sh [OUTDIR]   (resumable)
set -u
OUT=${1:-results/issue14-targets/explore-s8}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
V=(--method centroidkv-safe-fitted:merger.rounds=each+once
   --method centroidkv-safe-fitted:merger.rounds=once,merger.refine=6
   --method centroidkv-safe-fitted:merger.refine=6
   --method centroidkv-safe-fitted:merger.reference_queries=64
   --method kvzip-csm-fitted:merger.rounds=each+once
   --method kvzip-csm-fitted:merger.refine=6
   --method kvzip-csm-fitted:merger.queries=window+reconstruction
   --method kvzip-csm-fitted:merger.queries=window)
COMMON=(--budgets 0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full,centroidkv-safe,centroidkv-safe-fitted,kvzip-csm,kvzip-csm-fitted "${V[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full,centroidkv-safe,centroidkv-safe-fitted,kvzip-csm,kvzip-csm-fitted "${V[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
