#!/bin/bash
# the rest of run.sh after the planted-number step, resized for time: agreement as in run.sh, then
# query-aware on 5 samples (one per depth) instead of 10
cd /work/wt/h18
while kill -0 17212 2>/dev/null; do sleep 5; done   # the planted-number run of run.sh
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
EXTRA=,kvzip-sentences-median,kvzip-d2o-median
MG=full,streamingllm,snapkv,kvzip,kvzip-sentences,kvzip-d2o-tokens$EXTRA
MA=full,snapkv,kvzip,kvzip-d2o-tokens$EXTRA
C="--threads 1 --no-progress --no-plots --haystack $HAY"
O=results/issue18-grid
D="--depths 0.1,0.3,0.5,0.7,0.9"
$PY agreement --length 1024 --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $MG $C --out $O/agreement
$PY niah --fact number --distractors --lengths 2048 $D --samples 1 --budgets 0.25 --protocols aware --presets $MA $C --out $O/aware-distractors
