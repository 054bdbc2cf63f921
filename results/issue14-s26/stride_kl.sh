#!/bin/bash
# Session 26: does the fitted merger keep its KL with fewer reference queries (P = 48 instead of 96)?
# dev seed 13 (already used for tuning: not a held-out claim); noquery preset as registered, with the fit
# reading every 2nd of the 32 window queries, every 4th of 64, and the mean merger on the same clusters.
# Usage: bash results/issue14-s26/stride_kl.sh fidelity|agreement [seed]
O=/work/main/results/issue14-s26
task=$1; seed=${2:-13}
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
N=kvzip-copy-heads-noquery
MS=(--method "$N:merger.query_stride=2" --method "$N:merger.reference_queries=64,merger.query_stride=4"
    --method "$N:merger={\"name\":\"mean\"}")
out=$O/$task-2k-s$seed
echo "== $task s$seed start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
case $task in
agreement) $PY agreement --length 2048 --samples 8 --new-tokens 64 --presets snapkv,$N "${MS[@]}" --budgets 0.5,0.25 $H --seed $seed --out $out ;;
fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets snapkv,$N "${MS[@]}" --budgets 0.5,0.25 $H --seed $seed --out $out ;;
esac > $out.log 2>&1
echo "== $task s$seed done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
