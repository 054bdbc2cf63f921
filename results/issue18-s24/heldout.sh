#!/bin/bash
# Session 24's held-out runs of kvzip-copy-heads-noquery (seeds 19-20, never used before), every method in one run:
# the full cache, SnapKV, StreamingLLM, kvzip, kvzip-copy-heads-aligned and -noquery, main at the commit logged.
# Usage: bash results/issue18-s24/heldout.sh word-s19 distractors-s19 number-s19 agreement-s19 fidelity-s19
#        (facts: PG 2k, keep 0.25, depths 0.1-0.9, 2 samples a depth, question after compression;
#         agreement: 8 windows, 64 greedy tokens, keep 0.5 and 0.25; aware-s19: the facts with the question in the prompt)
O=/work/main/results/issue18-s24
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
P="snapkv,streamingllm,kvzip,kvzip-copy-heads-aligned,kvzip-copy-heads-noquery"
LEN=${LEN:-2048}; SAMPLES=${SAMPLES:-8}; K=$((LEN / 1024))k
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/$task-$K-s$seed
    echo "== $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/heldout.log
    F="--lengths $LEN --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 $H --seed $seed --out $out"
    case $task in
    agreement) $PY agreement --length $LEN --samples $SAMPLES --new-tokens 64 --presets $P --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    fidelity) $PY fidelity --prefix $LEN --continuation 256 --samples $SAMPLES --presets $P --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    word) $PY niah --fact code-word --protocols agnostic --presets full,$P $F ;;
    distractors) $PY niah --fact number --distractors --protocols agnostic --presets full,$P $F ;;
    number) $PY niah --needle number --protocols agnostic --presets full,$P $F ;;
    aware) $PY niah --needle number --protocols aware --presets full,kvzip-copy-heads-aligned,kvzip-copy-heads-noquery $F ;;
    esac > $out.log 2>&1
    echo "== $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/heldout.log
done
