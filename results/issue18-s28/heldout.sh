#!/bin/bash
# Session 28: kvzip-copy-heads-noquery and -whole beside the baselines at 4k on a seed no run had used (26).
# Usage: LEN=4096 bash results/issue18-s28/heldout.sh word-s26 number-s26
# LEN=4096 for 4k windows; SAMPLES (default 2) per depth; /usr/bin/time -v records max RSS in the .log
O=/work/main/results/issue18-s28
PY="nice -n 5 /usr/bin/time -v env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
P=snapkv,streamingllm,kvzip,kvzip-copy-heads-noquery,kvzip-copy-heads-whole
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; L=${LEN:-2048}; out=$O/heldout-$task-$((L / 1024))k-s$seed
    echo "== heldout $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
    F="--lengths $L --depths 0.1,0.3,0.5,0.7,0.9 --samples ${SAMPLES:-2} --budgets 0.25 $H --seed $seed --out $out"
    case $task in
    fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets $P --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    agreement) $PY agreement --length 2048 --samples 8 --new-tokens 64 --presets $P --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    distractors) $PY niah --fact number --distractors --protocols agnostic --presets full,$P $F ;;
    number) $PY niah --needle number --protocols agnostic --presets full,$P $F ;;
    word) $PY niah --fact code-word --protocols agnostic --presets full,$P $F ;;
    esac > $out.log 2>&1
    echo "== heldout $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
