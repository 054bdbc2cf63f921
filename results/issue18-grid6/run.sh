#!/bin/bash
# issue 18 target grid, session 11: kvzip-copy-heads-banded (the ImportanceGuard `band` of results/issue18-dev7,
# chosen on pydoc text only) beside the baselines on PG essays, at both of the issue's lengths. Every method in ONE
# run per task, nothing seeded; SmolLM2-135M, depths 0.1-0.9, 10 samples per fact, keep 0.25 (facts) and 0.5/0.25
# (fidelity, agreement); question after compression unless said. Code frozen at main a5f5548.
# Two tasks at a time (the machine has 2 cores), --threads 1 each, nice 5, in the order below; resumable.
# Usage: bash results/issue18-grid6/run.sh [step ...]   (no step: all, two at a time)
SRC=${SRC:-/work/wt/grid}
OUTROOT=${OUTROOT:-/work/main/results/issue18-grid6}
M=${M:-snapkv,streamingllm,kvzip,kvzip-copy-heads-banded}
STEPS="distractors-4k number-4k word-4k distractors-2k number-2k word-2k fidelity-2k agreement-2k fidelity-4k
       aware-4k aware-2k agreement-4k"
if [ $# -eq 0 ]; then
    echo $STEPS | tr ' ' '\n' | xargs -P 2 -I{} bash "$0" {}
    exit
fi
cd "$SRC"
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
D="--depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25"
O=$OUTROOT
for step in "$@"; do
    n=${step##*-}; L=$(( ${n%k} * 1024 ))
    echo "== $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/run.log
    case $step in
    word-*) $PY niah --fact code-word --lengths $L $D --presets full,$M $C --out $O/$step ;;
    distractors-*) $PY niah --fact number --distractors --lengths $L $D --presets full,$M $C --out $O/$step ;;
    number-*) $PY niah --needle number --lengths $L $D --presets full,$M $C --out $O/$step ;;
    aware-*) $PY niah --fact number --distractors --lengths $L $D --protocols aware --presets full,$M $C --out $O/$step ;;
    fidelity-*) $PY fidelity --prefix $L --continuation 256 --samples 4 --budgets 0.5,0.25 --presets $M $C --out $O/$step ;;
    agreement-*) $PY agreement --length $L --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $M $C --out $O/$step ;;
    esac > $O/$step.log 2>&1
    echo "== $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/run.log
done
