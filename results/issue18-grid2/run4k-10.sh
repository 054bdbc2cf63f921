#!/bin/bash
# 4k at 10 samples per fact (5 depths x 2 samples), extending run4k.sh's 5-sample probe (its s0 cells are
# kept: the eval skips finished cells by key and prompt hash). Run by the lead from /work/main after the merge.
cd /work/main
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
M=full,snapkv,kvzip,kvzip-sentences-surprisal,kvzip-hybrid
C="--threads 1 --no-progress --no-plots --haystack $HAY"
O=results/issue18-grid2
D="--depths 0.1,0.3,0.5,0.7,0.9"
$PY niah --fact code-word --lengths 4096 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/word-4k
$PY niah --fact number --distractors --lengths 4096 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/distractors-4k
$PY niah --needle number --lengths 4096 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/number-4k
