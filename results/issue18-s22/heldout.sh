#!/bin/bash
# Session 22's held-out runs (seeds never used for tuning: 14, 15), every method in one run, main at the commit logged.
# Usage: bash results/issue18-s22/heldout.sh agreement-s14 agreement-s15 fidelity-s14 ...   (steps run one after another)
#        LEN=4096 SAMPLES=4 bash results/issue18-s22/heldout.sh agreement-s16   (4k windows, 4 of them)
#        bash results/issue18-s22/heldout.sh word-s18 distractors-s18 number-s18   (facts: keep 0.25, depths 0.1-0.9,
#        2 samples a depth, question after compression, the full cache beside the methods; session 23)
O=/work/main/results/issue18-s22
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
M="--presets snapkv,streamingllm,kvzip,kvzip-copy-heads-aligned --budgets 0.5,0.25"
LEN=${LEN:-2048}; SAMPLES=${SAMPLES:-8}; K=$((LEN / 1024))k
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/$task-$K-s$seed
    echo "== $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/heldout.log
    case $task in
    agreement) $PY agreement --length $LEN --samples $SAMPLES --new-tokens 64 $M $H --seed $seed --out $out ;;
    word|distractors|number)
        F="--lengths $LEN --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 --protocols agnostic"
        F="$F --presets full,snapkv,streamingllm,kvzip,kvzip-copy-heads-aligned $H --seed $seed --out $out"
        case $task in
        word) $PY niah --fact code-word $F ;;
        distractors) $PY niah --fact number --distractors $F ;;
        number) $PY niah --needle number $F ;;
        esac ;;
    fidelity) $PY fidelity --prefix $LEN --continuation 256 --samples $SAMPLES $M $H --seed $seed --out $out ;;
    esac > $out.log 2>&1
    echo "== $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/heldout.log
done
