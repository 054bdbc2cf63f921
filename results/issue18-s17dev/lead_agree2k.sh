#!/bin/bash
# issue 18, session 17: kvzip-copy-heads-lead's agreement at 2k keep 0.25 on the windows of seeds 0-2 (its one
# separated loss to SnapKV at seed 3), SnapKV rerun beside it as the check that the windows and the full cache's
# summaries are the committed runs' (its LCS must equal theirs, window by window).
# Usage: SRC=<checkout> bash results/issue18-s17dev/lead_agree2k.sh
SRC=${SRC:-/work/wt/s17}
O=/work/main/results/issue18-s17dev
cd "$SRC"
for sn in "1 8" "2 8" "0 4"; do
    set -- $sn
    echo "== seed $1 start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C $SRC rev-parse --short HEAD)" >> $O/lead_agree2k.log
    nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval agreement --length 2048 \
        --samples $2 --new-tokens 64 --presets snapkv,kvzip-copy-heads-lead --budgets 0.25 --threads 1 --no-progress \
        --no-plots --seed $1 --haystack /work/shared/data/paul_graham_essays --out $O/lead-agree-2k-s$1 > $O/lead-agree-2k-s$1.log 2>&1
    echo "== seed $1 done rc=$? $(date +%T)" >> $O/lead_agree2k.log
done
