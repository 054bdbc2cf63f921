#!/bin/bash
# Session 30: greedy and teacher-forced agreement at 4k on seed 31, 4 windows, the new preset beside SnapKV and kvzip
# only (time). Usage: bash results/issue18-s30/agr4k.sh
O=/work/main/results/issue18-s30
out=$O/heldout-agreement-4k-s31
echo "== agr4k start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval agreement --length 4096 --new-tokens 64 \
    --samples 4 --presets snapkv,kvzip,kvzip-copy-heads-layers-sentences --budgets 0.5,0.25 --threads 1 --no-progress \
    --no-plots --haystack /work/shared/data/paul_graham_essays --seed 31 --out $out > $out.log 2>&1
echo "== agr4k done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
