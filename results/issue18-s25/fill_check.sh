#!/bin/bash
# Session 25: does choosing the slots above the guard's allowance cap (keep 0.25) per head by the reconstruction score
# (KVzip's choice) instead of SnapKV's window score win the answer path at keep 0.5? Seed 21 (never used before) decides;
# variant R is noquery with the clusterer's scorer swapped (every non-guard slot by reconstruction score).
# Usage: bash results/issue18-s25/fill_check.sh agreement-s21 fidelity-s21   (PG 2k, 8 windows, keep 0.5)
#        M='results/issue18-s25/fill0.5.json;results/issue18-s25/fill1.0.json' bash ... agreement-s19
#        (fillF.json: noquery with guard fill_share F, the slots above the keep-0.25 cap by reconstruction score)
O=/work/main/results/issue18-s25
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
P=${P:-snapkv,kvzip,kvzip-copy-heads-noquery}
M=${M:-'kvzip-copy-heads-noquery:clusterer.scorer={"name":"reconstruction"}'}  # one or more, separated by ';'
MS=(); IFS=';' read -ra MM <<< "$M"; for m in "${MM[@]}"; do MS+=(--method "$m"); done
B=${B:-0.5}
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/$task-2k-s$seed-k$B
    echo "== $step k$B start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
    case $task in
    agreement) $PY agreement --length 2048 --samples 8 --new-tokens 64 --presets $P "${MS[@]}" --budgets $B $H --seed $seed --out $out ;;
    fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets $P "${MS[@]}" --budgets $B $H --seed $seed --out $out ;;
    esac > $out.log 2>&1
    echo "== $step k$B done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
