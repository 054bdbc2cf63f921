#!/bin/bash
# Session 29: kvzip-copy-heads-layers beside the baselines on seeds no run had used (28+), one run per task.
# noquery is left out to halve the cost (its reconstruction variant is the expensive one); add it with EXTRA=,kvzip-copy-heads-noquery.
# Usage: LEN=2048 bash results/issue18-s29/heldout.sh distractors-s28 number-s28 word-s28 fidelity-s28 agreement-s28
# O (the output folder) and MAIN (the preset measured) default to session 29's; session 30 sets both (its heldout.sh).
O=${O:-/work/main/results/issue18-s29}
MAIN=${MAIN:-kvzip-copy-heads-layers}
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
P=snapkv,streamingllm,kvzip,${MAIN}${EXTRA}
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; L=${LEN:-2048}; out=$O/heldout-$task-$((L / 1024))k-s$seed
    echo "== heldout $step L=$L start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
    F="--lengths $L --depths 0.1,0.3,0.5,0.7,0.9 --samples ${SAMPLES:-2} --budgets 0.25 $H --seed $seed --out $out"
    case $task in
    fidelity) $PY fidelity --prefix $L --continuation 256 --samples 8 --presets $P --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    agreement) $PY agreement --length $L --samples 8 --new-tokens 64 --presets $P --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    distractors) $PY niah --fact number --distractors --protocols agnostic --presets full,$P $F ;;
    number) $PY niah --needle number --protocols agnostic --presets full,$P $F ;;
    word) $PY niah --fact code-word --protocols agnostic --presets full,$P $F ;;
    aware) $PY niah --fact number --distractors --protocols aware --presets full,snapkv,${AWARE:-kvzip-copy-heads-layers-sentences} $F ;;
    esac > $out.log 2>&1
    echo "== heldout $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
