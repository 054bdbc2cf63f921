#!/bin/bash
# issue 14, session 18: the fitted merger's refine_share 0.125 (the key steps and the value solve move an eighth of
# each head's fitted slots) on kvzip-copy-heads-lead, KL at 4k on seed 3's windows, paired with the committed
# lead cells of results/issue18-seed3/fidelity-4k (same windows, same library code). Then agreement 4k likewise.
# Usage: SRC=<checkout of main> bash results/issue18-s18/share0125.sh [fidelity-4k agreement-4k ...]
SRC=${SRC:-/work/wt/s18}
O=/work/main/results/issue18-s18
cd "$SRC"
C="--threads 1 --no-progress --no-plots --seed 3 --budgets 0.5,0.25 --haystack /work/shared/data/paul_graham_essays"
V="kvzip-copy-heads-lead:merger.refine_share=0.125"
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval"
for step in ${*:-fidelity-4k}; do
    n=${step##*-}; L=$(( ${n%k} * 1024 ))
    echo "== share0125 $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C $SRC rev-parse --short HEAD)" >> $O/share0125.log
    case $step in
    fidelity-*) $PY fidelity --prefix $L --continuation 256 --samples 8 --method $V $C --out $O/share0125-$step ;;
    agreement-*) $PY agreement --length $L --samples 8 --new-tokens 64 --method $V $C --out $O/share0125-$step ;;
    esac > $O/share0125-$step.log 2>&1
    echo "== share0125 $step done rc=$? $(date +%T)" >> $O/share0125.log
done
