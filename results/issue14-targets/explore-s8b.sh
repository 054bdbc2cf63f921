#!/bin/bash
# Issue 14, session 8, second exploration: query sources that keep the guarded presets' clusters
# (the -safe guard reads every captured window query, so a longer window would change its clusters):
# window + strided prefill queries, the window alone for kvzip-csm-fitted; keep 0.5 and 0.25.
#   bash results/issue14-targets/explore-s8b.sh [OUTDIR]   (resumable)
set -u
OUT=${1:-results/issue14-targets/explore-s8b}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
V=(--method centroidkv-safe-fitted:merger.queries=window+prefill
   --method centroidkv-safe-fitted:merger.queries=window+prefill,merger.rounds=once
   --method centroidkv-safe-fitted:merger.queries=window+prefill,merger.rounds=each+once
   --method kvzip-csm-fitted:merger.queries=window
   --method kvzip-csm-fitted:merger.queries=window,merger.rounds=once
   --method kvzip-csm-fitted:merger.queries=window+reconstruction)
COMMON=(--budgets 0.5,0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full,centroidkv-safe,centroidkv-safe-fitted,kvzip-csm,kvzip-csm-fitted "${V[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full,centroidkv-safe,centroidkv-safe-fitted,kvzip-csm,kvzip-csm-fitted "${V[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
