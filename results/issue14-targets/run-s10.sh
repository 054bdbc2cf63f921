#!/bin/bash
# Issue 14, session 10: the targets table in ONE run with the fitted presets' new refine_share=0.25 (the
# fitting code of branch h14 at the commit named in s10/README, from a snapshot): fitted presets beside their
# mean-merger twins (centroidkv-safe:query_window=64 is centroidkv-safe-fitted's same-cluster twin), SnapKV,
# StreamingLLM and kvzip; fidelity and generation agreement on PG essays and pydoc at keep 0.5 and 0.25;
# then NIAH (2k, 3 depths) fitted vs mean.
#   bash results/issue14-targets/run-s10.sh [OUTDIR]   (from the repository root or a snapshot of it;
#   resumable: every command skips the cells its cells.jsonl already holds)
set -u
OUT=${1:-results/issue14-targets/s10}
PY="nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval"
export HF_HUB_OFFLINE=1
PG=/work/shared/data/paul_graham_essays
M="snapkv,streamingllm,kvzip,centroidkv,centroidkv-fitted,centroidkv-safe,centroidkv-safe-fitted,semanticache-fixed64,semanticache-fitted,kvzip-csm,kvzip-csm-fitted"
TWIN=(--method centroidkv-safe:query_window=64)
COMMON=(--budgets 0.5,0.25 --threads 1 --samples 1 --no-progress --no-plots --backend sdpa)
$PY fidelity --haystack $PG --presets full,$M "${TWIN[@]}" "${COMMON[@]}" --out $OUT/fidelity-pg
$PY fidelity --presets full,$M "${TWIN[@]}" "${COMMON[@]}" --out $OUT/fidelity-pydoc
$PY agreement --haystack $PG --presets $M "${TWIN[@]}" "${COMMON[@]}" --out $OUT/agreement-pg
$PY agreement --presets $M "${TWIN[@]}" "${COMMON[@]}" --out $OUT/agreement-pydoc
$PY niah --lengths 2048 --depths 0.1,0.5,0.9 --samples 1 \
    --presets centroidkv,centroidkv-fitted,centroidkv-safe,centroidkv-safe-fitted,kvzip-csm,kvzip-csm-fitted \
    --method centroidkv-safe:query_window=64 --budgets 0.5,0.25 --protocols agnostic \
    --threads 1 --no-progress --no-plots --backend sdpa --out $OUT/niah-2k
