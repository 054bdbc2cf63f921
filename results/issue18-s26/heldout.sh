#!/bin/bash
# Session 26: noquery with other_token_share 0.25 (noquery-ots0.25.json; dev: seed 13's fidelity and seed 20's
# distractors) against the preset as registered on seed 22 (never used before), with the baselines in one run.
# StreamingLLM (and kvzip in the facts) were added by a resumed run of the same folders (only their cells ran).
# Usage: bash results/issue18-s26/heldout.sh fidelity-s22 agreement-s22 distractors-s22 number-s22 word-s22
O=/work/main/results/issue18-s26
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
V=(--method results/issue18-s26/noquery-ots0.25.json)
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; out=$O/heldout-$task-2k-s$seed
    echo "== heldout $step start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
    F="--lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 $H --seed $seed --out $out"
    case $task in
    fidelity) $PY fidelity --prefix 2048 --continuation 256 --samples 8 --presets snapkv,streamingllm,kvzip,kvzip-copy-heads-noquery "${V[@]}" --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    agreement) $PY agreement --length 2048 --samples 8 --new-tokens 64 --presets snapkv,streamingllm,kvzip,kvzip-copy-heads-noquery "${V[@]}" --budgets 0.5,0.25 $H --seed $seed --out $out ;;
    distractors) $PY niah --fact number --distractors --protocols agnostic --presets full,snapkv,streamingllm,kvzip,kvzip-copy-heads-noquery "${V[@]}" $F ;;
    number) $PY niah --needle number --protocols agnostic --presets full,snapkv,streamingllm,kvzip,kvzip-copy-heads-noquery "${V[@]}" $F ;;
    word) $PY niah --fact code-word --protocols agnostic --presets full,snapkv,streamingllm,kvzip,kvzip-copy-heads-noquery "${V[@]}" $F ;;
    esac > $out.log 2>&1
    echo "== heldout $step done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
done
