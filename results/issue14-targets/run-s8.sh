#!/bin/bash
# Issue 14, session 8: every cell of the targets table in ONE run, from one tree (branch h14 at the commit
# named in s8/README: the guarded presets fitted once to their query window, centroidkv-safe-fitted's
# window 64). Beside the fitted presets: their mean-merger twins (centroidkv-safe:query_window=64 is
# centroidkv-safe-fitted's same-cluster twin: its guard reads the same 64 queries), the closed form alone
# (refine=0), SnapKV, StreamingLLM and kvzip; fidelity and generation agreement on PG essays and pydoc
# at keep 0.5 and 0.25; then NIAH (2k, 3 depths) fitted vs mean.
#   bash results/issue14-targets/run-s8.sh [OUTDIR]     (from the repository root; resumable:
#   every command skips the cells its cells.jsonl already holds)
set -u
OUT=${1:-results/issue14-targets/s8}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
M="snapkv,streamingllm,kvzip,centroidkv,centroidkv-fitted,centroidkv-safe,centroidkv-safe-fitted,semanticache-fixed64,semanticache-fitted,kvzip-csm,kvzip-csm-fitted"
TWIN=(--method centroidkv-safe:query_window=64)
CLOSED=(--method centroidkv-fitted:merger.refine=0 --method centroidkv-safe-fitted:merger.refine=0
        --method semanticache-fitted:merger.refine=0 --method kvzip-csm-fitted:merger.refine=0)
COMMON=(--budgets 0.5,0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full,$M "${TWIN[@]}" "${CLOSED[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full,$M "${TWIN[@]}" "${CLOSED[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
$PY agreement --haystack $PG --presets $M "${TWIN[@]}" "${COMMON[@]}" --out $OUT/agreement-pg
$PY agreement --presets $M "${TWIN[@]}" "${COMMON[@]}" --out $OUT/agreement-pydoc
$PY niah --lengths 2048 --depths 0.1,0.5,0.9 --samples 1 \
    --presets centroidkv,centroidkv-fitted,centroidkv-safe,centroidkv-safe-fitted,kvzip-csm,kvzip-csm-fitted \
    --method centroidkv-safe:query_window=64 --budgets 0.5,0.25 --protocols agnostic \
    --threads 1 --no-progress --no-plots --backend sdpa --out $OUT/niah-2k
