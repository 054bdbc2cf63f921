#!/bin/bash
# Issue 14, session 26: the fitted presets' KL cut against their mean-merger twins (session 10's targets table,
# results/issue14-targets/run-s10.sh: PG essays and pydoc, keep 0.5 and 0.25, 1000-token prefix, 500 continuation)
# with the fit reading every 2nd of its window queries (merger.query_stride=2; 4 for centroidkv-safe-fitted's 64),
# beside the presets as registered, SnapKV and the full cache, 2 windows per haystack, one run per haystack.
#   bash results/issue14-s26/targets.sh pg|pydoc
set -u
O=/work/main/results/issue14-s26
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
M="snapkv,centroidkv,centroidkv-fitted,centroidkv-safe-fitted,semanticache-fixed64,semanticache-fitted,semanticache-safe,semanticache-safe-fitted,kvzip-csm,kvzip-csm-fitted"
V=(--method centroidkv-safe:query_window=64)
for p in centroidkv-fitted semanticache-fitted semanticache-safe-fitted kvzip-csm-fitted centroidkv-safe-fitted; do
    V+=(--method "$p:merger.query_stride=2")
done
V+=(--method "centroidkv-safe-fitted:merger.query_stride=4")
case $1 in pg) HS=(--haystack /work/shared/data/paul_graham_essays) ;; pydoc) HS=() ;; esac
out=$O/targets-fidelity-$1
echo "== targets $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
$PY fidelity "${HS[@]}" --presets full,$M "${V[@]}" --budgets 0.5,0.25 --threads 1 --samples 2 --no-progress --no-plots \
    --backend sdpa --out $out > $out.log 2>&1
echo "== targets $1 done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
