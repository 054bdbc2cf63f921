#!/bin/bash
# Session 24 dev check (seed 13, PG 2k, 5 windows; not a held-out claim): at keep 0.5 the held-out seed 19 put kvzip's
# per-head eviction ahead of kvzip-copy-heads-noquery on the answer path. Variant R: noquery with the slots left after the
# guard's allowance chosen per head by the reconstruction score (kvzip's choice) instead of SnapKV's window score.
# Usage: bash results/issue18-s24/dev_fill.sh 0.5
O=/work/main/results/issue18-s24
R='kvzip-copy-heads-noquery:clusterer.scorer={"name":"reconstruction"}'
out=$O/dev-fill-2k-s13-k$1
echo "== dev-fill $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/heldout.log
nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval agreement --length 2048 --samples 5 \
    --new-tokens 64 --presets kvzip,kvzip-copy-heads-noquery --method "$R" --budgets $1 --threads 1 --no-progress --no-plots \
    --haystack /work/shared/data/paul_graham_essays --seed 13 --out $out > $out.log 2>&1
echo "== dev-fill $1 done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/heldout.log
