#!/bin/bash
# Issue 14, session 9: KL of cheaper fits (refine_share: the key steps move only the most-attended share of
# the fitted slots) against the default fit and the mean twin. bash results/issue14-targets/explore-s9.sh OUT METHODS...
set -u
OUT=$1; shift
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
ARGS=(); for m in "$@"; do ARGS+=(--method "$m"); done
COMMON=(--budgets 0.5,0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full "${ARGS[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full "${ARGS[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
