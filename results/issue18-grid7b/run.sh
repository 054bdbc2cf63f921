#!/bin/bash
# grid7b: the same with allowance_keep 0.375 (the preset only, as a method override; M set by the caller)
set -f  # the method override holds [ and {
# issue 18 target grid, session 14: kvzip-copy-heads-banded with its allowances sized at keep 0.25 at most
# (guard allowance_keep, main 5a7d223) beside the baselines on PG essays, 2k and 4k, at keep 0.5: the budget the
# change touches. At keep 0.25 the preset is mask for mask the one of grid6 (tests/test_importance_allowance.py),
# so grid6's keep-0.25 cells (facts, query-aware, KL and LCS at 0.25) stand. Every method in ONE run per task,
# nothing seeded, SmolLM2-135M, 4 windows per cell; --threads 1 each, nice 5, two tasks at a time.
# Usage: bash results/issue18-grid7/run.sh [step ...]   (no step: all, two at a time)
SRC=${SRC:-/work/wt/grid7}
OUTROOT=${OUTROOT:-/work/main/results/issue18-grid7b}
M=${M:-snapkv,streamingllm,kvzip,kvzip-copy-heads-banded}
STEPS="fidelity-4k agreement-4k fidelity-2k agreement-2k"
if [ $# -eq 0 ]; then
    echo $STEPS | tr ' ' '\n' | xargs -P 2 -I{} bash "$0" {}
    exit
fi
cd "$SRC"
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
O=$OUTROOT
MARGS="--method $M"
for step in "$@"; do
    n=${step##*-}; L=$(( ${n%k} * 1024 ))
    echo "== $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/run.log
    case $step in
    fidelity-*) $PY fidelity --prefix $L --continuation 256 --samples 4 --budgets 0.5 $MARGS $C --out $O/$step ;;
    agreement-*) $PY agreement --length $L --samples 4 --new-tokens 64 --budgets 0.5 $MARGS $C --out $O/$step ;;
    esac > $O/$step.log 2>&1
    echo "== $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/run.log
done
