#!/bin/bash
# issue 18, session 17: the lead-in preset alone on the depth-0.5 samples of seeds 0-2 at 4k with distractor numbers,
# where kvzip-copy-heads-banded missed every needle within ~30 tokens of a reconstruction chunk start (5 of 6 there
# are such; full cache 6/6). The other methods' cells of those samples are the committed runs' (same sample ids).
# Usage: SRC=<checkout> bash results/issue18-s17dev/lead_d05.sh
SRC=${SRC:-/work/wt/s17}
O=/work/main/results/issue18-s17dev
cd "$SRC"
for seed in 0 1 2; do
    echo "== seed $seed start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C $SRC rev-parse --short HEAD)" >> $O/lead_d05.log
    nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval niah --fact number \
        --distractors --lengths 4096 --depths 0.5 --samples 2 --budgets 0.25 --presets kvzip-copy-heads-lead \
        --threads 1 --no-progress --no-plots --seed $seed --haystack /work/shared/data/paul_graham_essays \
        --out $O/lead-d05-4k-s$seed > $O/lead-d05-4k-s$seed.log 2>&1
    echo "== seed $seed done rc=$? $(date +%T)" >> $O/lead_d05.log
done
