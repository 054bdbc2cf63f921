#!/bin/bash
# Session 28: kvzip-copy-heads-layers added to the 4k seed-26 run folders (a resumed run: the same windows and
# needles, only the new preset's cells computed). Usage: bash results/issue18-s28/add-layers-4k.sh word-s26 number-s26
O=/work/main/results/issue18-s28
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
P=snapkv,streamingllm,kvzip,kvzip-copy-heads-noquery,kvzip-copy-heads-whole,kvzip-copy-heads-layers
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/heldout-$task-4k-s$seed
    echo "== add-layers $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
    F="--lengths 4096 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 $H --seed $seed --out $out"
    case $task in
    number) $PY niah --needle number --protocols agnostic --presets full,$P $F ;;
    word) $PY niah --fact code-word --protocols agnostic --presets full,$P $F ;;
    esac > $out-layers.log 2>&1
    echo "== add-layers $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
