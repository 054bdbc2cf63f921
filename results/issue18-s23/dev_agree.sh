#!/bin/bash
# Session 23 dev check (seed 13, the dev seed of session 22's answer-path sweep): does the question-free guard
# variant q0 (query_share 0) cost agreement against the preset? Usage: bash results/issue18-s23/dev_agree.sh 0.25
O=/work/main/results/issue18-s23
source "$(dirname "$0")/variants.sh"
out=$O/dev-agree-2k-s13-k$1
echo "== agree $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/diag.log
nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval agreement --length 2048 --samples 5 \
    --new-tokens 64 --presets kvzip-copy-heads-aligned --method "$Q0" --budgets $1 --threads 1 --no-progress --no-plots \
    --haystack /work/shared/data/paul_graham_essays --seed 13 --out $out > $out.log 2>&1
echo "== agree $1 done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/diag.log
