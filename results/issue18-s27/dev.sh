#!/bin/bash
# Session 27, dev (spent seeds: 20 and 22 were held out in sessions 24 and 26): kvzip-copy-heads-whole added, by a
# resumed run, to copies of the folders where noquery missed (only its cells computed; the same windows and needles).
# Usage: bash results/issue18-s27/dev.sh word-s22 distractors-s22 distractors-s20
O=/work/main/results/issue18-s27
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/dev-$task-2k-s$seed
    case $seed in 22) src=/work/main/results/issue18-s26/heldout-$task-2k-s22 ;; 20) src=/work/main/results/issue18-s24/$task-2k-s20 ;; esac
    [ -d $out ] || cp -r $src $out
    echo "== dev $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD) from $src" >> $O/runs.log
    F="--lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 $H --seed $seed --out $out"
    case $task in
    distractors) $PY niah --fact number --distractors --protocols agnostic --presets full,snapkv,kvzip-copy-heads-noquery,kvzip-copy-heads-whole $F ;;
    word) $PY niah --fact code-word --protocols agnostic --presets full,snapkv,kvzip-copy-heads-noquery,kvzip-copy-heads-whole $F ;;
    esac > $out.log 2>&1
    echo "== dev $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
