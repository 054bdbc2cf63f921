#!/bin/bash
# Session 26 (dev, seed 13: not a held-out claim): does the fitted merger do better when every token left out
# merges into its most similar kept token (clusterer.threshold -1) or at cosine >= 0, instead of D2O's mean
# threshold (the rest dropped)? Usage: bash results/issue18-s26/merge_all.sh fidelity|agreement [seed] [budgets]
O=/work/main/results/issue18-s26
task=$1; seed=${2:-13}; B=${3:-0.5,0.25}
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
N=kvzip-copy-heads-noquery
MS=(--method "$N:clusterer.threshold=-1.0" --method "$N:clusterer.threshold=0.0")
out=$O/mergeall-$task-2k-s$seed
echo "== mergeall $task s$seed $B start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
case $task in
agreement) $PY agreement --length 2048 --samples 8 --new-tokens 64 --presets $N "${MS[@]}" --budgets $B $H --seed $seed --out $out ;;
fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets $N "${MS[@]}" --budgets $B $H --seed $seed --out $out ;;
esac > $out.log 2>&1
echo "== mergeall $task s$seed done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
