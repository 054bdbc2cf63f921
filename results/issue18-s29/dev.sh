#!/bin/bash
# Session 29 dev: copy_sentence_scale variants (dev/*.json) added to copies of spent run folders (a resumed run:
# the same windows and needles, only the new methods' cells computed).
# Usage: bash results/issue18-s29/dev.sh distractors-s28 fidelity-s23
O=/work/main/results/issue18-s29
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
M="--method $O/dev/l2s2.json --method $O/dev/l2s15.json --method $O/dev/l3s2.json"
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/dev-$task-2k-s$seed
    echo "== dev $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)+copy_sentence_scale" >> $O/runs.log
    F="--lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 $H --seed $seed --out $out"
    case $task in
    fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets kvzip-copy-heads-layers $M --budgets 0.25 $H --seed $seed --out $out ;;
    distractors) $PY niah --fact number --distractors --protocols agnostic --presets full $M $F ;;
    esac > $out.log 2>&1
    echo "== dev $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
