#!/bin/bash
# 4k probe after the 2k grid (time left for 5 samples per fact, one per depth): full, SnapKV,
# KVzip and the two surprisal presets, question after compression, keep 0.25. RSS of the eval
# process logged every 20 s to rss4k.log (kvzip-hybrid is D2O-based; the eager-attention H2O/D2O
# baselines are not run at 4k). Resumable.
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
M=full,snapkv,kvzip,kvzip-sentences-surprisal,kvzip-hybrid
C="--threads 1 --no-progress --no-plots --haystack $HAY"
O=results/issue18-grid2
D="--depths 0.1,0.3,0.5,0.7,0.9"
( while true; do for p in $(pgrep -f "kvcompress.cli eval .*-4k"); do
    echo "$(date -u +%H:%M:%S) $p $(( $(awk '/VmRSS/{print $2}' /proc/$p/status 2>/dev/null || echo 0) / 1024 )) MiB"; done; sleep 20; done ) >> $O/rss4k.log &
RSS=$!
$PY niah --fact number --distractors --lengths 4096 $D --samples 1 --budgets 0.25 --presets $M $C --out $O/distractors-4k
$PY niah --fact code-word --lengths 4096 $D --samples 1 --budgets 0.25 --presets $M $C --out $O/word-4k
kill $RSS
