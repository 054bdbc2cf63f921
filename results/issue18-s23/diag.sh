#!/bin/bash
# Session 23 diagnosis on seed 18's fact windows (already held out and reported; nothing here is a held-out claim):
# does the guard's allowance, not its ranking, lose the numbers? The guard variants Q0 and ALL of variants.sh.
# Usage: bash results/issue18-s23/diag.sh number distractors
O=/work/main/results/issue18-s23
source "$(dirname "$0")/variants.sh"
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval niah"
F="--lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 --protocols agnostic --threads 1 --no-progress --no-plots"
F="$F --haystack /work/shared/data/paul_graham_essays --seed ${SEED:-18}"
for task in "$@"; do
    out=$O/diag-$task-s${SEED:-18}
    echo "== $task start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/diag.log
    case $task in
    number) $PY --needle number --method "$Q0" --method "$ALL" $F --out $out ;;
    distractors) $PY --fact number --distractors --method "$Q0" --method "$ALL" $F --out $out ;;
    word) $PY --fact code-word --method "$Q0" --method "$ALL" $F --out $out ;;
    esac > $out.log 2>&1
    echo "== $task done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/diag.log
done
