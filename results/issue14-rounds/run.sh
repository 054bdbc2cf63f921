#!/bin/bash
# Issue 14, session 5: fit once (the default) against fit after every round (rounds=each, the
# previous behaviour), and the key the fit uses, at keep 0.25 where fitting once lost KL. Resumable:
#   bash results/issue14-rounds/run.sh OUTDIR
set -u
OUT=${1:-results/issue14-rounds}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
M=(--method 'centroidkv-fitted:merger.rounds=each' --method 'centroidkv-safe-fitted:merger.rounds=each'
   --method 'kvzip-csm-fitted:merger.rounds=each' --method 'kvzip-csm-fitted:merger.key=mean'
   --method 'semanticache-fitted:merger.reference_queries=64')
COMMON=(--budgets 0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full "${M[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full "${M[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
# then: every round fitted AND the final slots refitted against the original members
M2=(--method 'kvzip-csm-fitted:merger.rounds=each+once' --method 'centroidkv-safe-fitted:merger.rounds=each+once')
$PY fidelity --haystack $PG --presets full "${M2[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full "${M2[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
