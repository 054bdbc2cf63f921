#!/bin/bash
# issue 18, session 15: the grid's question-free agreement and KL cells on windows never used to choose anything
# (--seed 1: other PG windows than grids 6/7, whose seed 0 windows the presets' parameters were read from),
# keep 0.5 and 0.25, 2k and 4k, and the facts at keep 0.25, every method in ONE run per task; SmolLM2-135M, --threads 1, nice 5, two at a time.
# Usage: bash results/issue18-heldout/run.sh [step ...]   (no step: all, two at a time)
SRC=${SRC:-/work/wt/grid7}
OUTROOT=${OUTROOT:-/work/main/results/issue18-heldout}
M=${M:-snapkv,streamingllm,kvzip,kvzip-copy-heads-banded}
N=${N:-8}
SEED=${SEED:-1}
STEPS=${STEPS:-"agreement-4k agreement-2k fidelity-4k fidelity-2k"}
if [ $# -eq 0 ]; then
    echo $STEPS | tr ' ' '\n' | xargs -P 2 -I{} bash "$0" {}
    exit
fi
cd "$SRC"
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed $SEED --budgets 0.5,0.25 --haystack /work/shared/data/paul_graham_essays"
# the facts at keep 0.25 as in grid6 (depths 0.1-0.9, 2 a depth), on other haystack draws (--seed 1)
C1="--threads 1 --no-progress --no-plots --seed $SEED --haystack /work/shared/data/paul_graham_essays"
D="--depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25"
O=$OUTROOT
for step in "$@"; do
    case $step in wait-*) while kill -0 ${step#wait-} 2>/dev/null; do sleep 20; done; continue ;; esac  # a slot held
    n=${step##*-}; L=$(( ${n%k} * 1024 ))
    echo "== $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C $SRC rev-parse --short HEAD)" >> $O/run.log
    case $step in
    word-*) $PY niah --fact code-word --lengths $L $D --presets full,$M $C1 --out $O/$step ;;
    distractors-*) $PY niah --fact number --distractors --lengths $L $D --presets full,$M $C1 --out $O/$step ;;
    number-*) $PY niah --needle number --lengths $L $D --presets full,$M $C1 --out $O/$step ;;
    fidelity-*) $PY fidelity --prefix $L --continuation 256 --samples $N --presets $M $C --out $O/$step ;;
    agreement-*) $PY agreement --length $L --samples $N --new-tokens 64 --presets $M $C --out $O/$step ;;
    esac > $O/$step.log 2>&1
    echo "== $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/run.log
done
