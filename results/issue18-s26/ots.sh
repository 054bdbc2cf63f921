#!/bin/bash
# Session 26 (diagnosis, not held out): keep 0.25, noquery with its heads without sentences giving less of their room
# to reconstruction-ranked tokens (other_token_share 0.25 / 0.0 instead of 0.5; the rest: SnapKV's choice and D2O
# merging). fidelity on seed 13 (dev), the number among distractors on seed 20 (spent by session 24: its 5/10).
# Usage: bash results/issue18-s26/ots.sh fidelity-s13 distractors-s20 ...
O=/work/main/results/issue18-s26
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
MS=(--method results/issue18-s26/noquery-ots0.25.json --method results/issue18-s26/noquery-ots0.0.json)
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/ots-$task-2k-s$seed
    echo "== ots $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
    case $task in
    fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets snapkv,kvzip-copy-heads-noquery "${MS[@]}" --budgets 0.25 $H --seed $seed --out $out ;;
    agreement) $PY agreement --length 2048 --samples 8 --new-tokens 64 --presets snapkv,kvzip-copy-heads-noquery "${MS[@]}" --budgets 0.25 $H --seed $seed --out $out ;;
    distractors) $PY niah --fact number --distractors --protocols agnostic --presets kvzip-copy-heads-noquery "${MS[@]}" --lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 $H --seed $seed --out $out ;;
    esac > $out.log 2>&1
    echo "== ots $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
