#!/bin/bash
# issue 18, session 18: kvzip-copy-heads-lead alone on the facts cells of seeds 0-2 (keep 0.25, depths 0.1-0.9, 2 a
# depth, question after compression), so the newest preset is pooled over the same four seeds as banded. The other
# methods' cells of those samples are the committed runs' (grid6 = seed 0, issue18-heldout = 1, issue18-seed2 = 2:
# the same sample ids and expected values). Steps TASK-LEN-sSEED, in the order given; DEPTHS overrides the depths
# (distractors-4k at depth 0.5 is results/issue18-s17dev/lead-d05-4k-s*: the same samples, run in session 17).
# Usage: SRC=<checkout of main> [DEPTHS=0.1,0.3,0.7,0.9] bash results/issue18-s18/lead_facts.sh number-2k-s1 ...
SRC=${SRC:-/work/wt/s18}
O=/work/main/results/issue18-s18
DEPTHS=${DEPTHS:-0.1,0.3,0.5,0.7,0.9}
cd "$SRC"
for step in "$@"; do
    case $step in wait-*) while kill -0 ${step#wait-} 2>/dev/null; do sleep 20; done; continue ;; esac
    seed=${step##*-s}; task=${step%-s*}; n=${task##*-}; L=$(( ${n%k} * 1024 ))
    case $task in
    word-*) F="--fact code-word" ;;
    distractors-*) F="--fact number --distractors" ;;
    number-*) F="--needle number" ;;
    esac
    out=$O/lead-$step
    echo "== $step depths $DEPTHS start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C $SRC rev-parse --short HEAD)" >> $O/lead_facts.log
    nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval niah $F \
        --lengths $L --depths $DEPTHS --samples 2 --budgets 0.25 --presets kvzip-copy-heads-lead \
        --threads 1 --no-progress --no-plots --seed $seed --haystack /work/shared/data/paul_graham_essays \
        --out $out > $out.log 2>&1
    echo "== $step done rc=$? $(date +%T)" >> $O/lead_facts.log
done
