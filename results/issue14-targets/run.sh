#!/bin/bash
# Issue 14 targets on SmolLM2-135M (one window per haystack, keep 0.5 and 0.25), resumable:
#   bash results/issue14-targets/run.sh OUTDIR
# run from a tree holding main + h14 + h18's cb4704a (the kvzip copy path of the eval).
set -u
OUT=${1:-results/issue14-targets}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
M="snapkv,centroidkv,centroidkv-fitted,centroidkv-safe,centroidkv-safe-fitted,semanticache-fixed64,semanticache-fitted,kvzip-csm,kvzip-csm-fitted"
ABL=(--method 'centroidkv-fitted:merger.queries=prefill' --method 'centroidkv-fitted:merger.queries=reconstruction')
COMMON=(--budgets 0.5,0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full,$M "${ABL[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full,$M "${ABL[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
$PY agreement --haystack $PG --presets $M "${COMMON[@]}" --out $OUT/agreement-pg
$PY agreement --presets $M "${COMMON[@]}" --out $OUT/agreement-pydoc
