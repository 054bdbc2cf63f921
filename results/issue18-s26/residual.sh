#!/bin/bash
# Session 26 (dev, seed 13 unless given: not a held-out claim): d2o-similar's ``residual`` share, the tokens D2O's
# test drops gathered into slots of their own (kept tokens stay exact), fitted by the noquery preset's merger.
# Needs results/issue18-s26/residual.patch applied (git apply): the clusterer parameter was not kept (no gain).
# Usage: bash results/issue18-s26/residual.sh fidelity|agreement [seed] [budgets] [shares]
O=/work/main/results/issue18-s26
task=$1; seed=${2:-13}; B=${3:-0.5,0.25}; SH=${4:-0.1,0.25}
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
N=kvzip-copy-heads-noquery
MS=(); for r in ${SH//,/ }; do MS+=(--method "$N:clusterer.residual=$r"); done
out=$O/residual-$task-2k-s$seed
echo "== residual $task s$seed $B $SH start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD) (dirty: similar.py)" >> $O/runs.log
case $task in
agreement) $PY agreement --length 2048 --samples 8 --new-tokens 64 --presets snapkv,kvzip,$N "${MS[@]}" --budgets $B $H --seed $seed --out $out ;;
fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets snapkv,$N "${MS[@]}" --budgets $B $H --seed $seed --out $out ;;
esac > $out.log 2>&1
echo "== residual $task s$seed done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
