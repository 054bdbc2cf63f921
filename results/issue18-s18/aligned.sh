#!/bin/bash
# issue 18, session 18: kvzip-copy-heads-aligned (kvzip-copy-heads-lead with the pass's chunks at their full-repeat
# positions) alone, keep 0.25, question after compression; the other methods' cells of the same samples are the
# committed runs' (seed 3: results/issue18-seed3; seeds 0-2: grid6 / issue18-heldout / issue18-seed2).
# Steps: TASK-LEN-sSEED (facts; DEPTHS, default 0.1-0.9), agreement-LEN-sSEED or fidelity-LEN-sSEED (keep 0.5 and
# 0.25, 8 windows; fidelity: KL over 256 teacher-forced tokens, session 19).
# Usage: SRC=<checkout of main d3234e9> [DEPTHS=0.9] [SAMPLES=4 (fidelity, agreement; default 8)] bash results/issue18-s18/aligned.sh number-2k-s3 ...
SRC=${SRC:-/work/wt/s18b}
O=/work/main/results/issue18-s18
P=kvzip-copy-heads-aligned
DEPTHS=${DEPTHS:-0.1,0.3,0.5,0.7,0.9}
cd "$SRC"
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval"
H="--threads 1 --no-progress --no-plots --haystack /work/shared/data/paul_graham_essays"
for step in "$@"; do
    seed=${step##*-s}; task=${step%-s*}; n=${task##*-}; L=$(( ${n%k} * 1024 ))
    tag=$task; [ "$DEPTHS" != "0.1,0.3,0.5,0.7,0.9" ] && tag=$task-d${DEPTHS//[.,]/}
    out=$O/aligned-$tag-s$seed
    echo "== $step depths $DEPTHS start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C $SRC rev-parse --short HEAD)" >> $O/aligned.log
    case $task in
    word-*) $PY niah --fact code-word --lengths $L --depths $DEPTHS --samples 2 --budgets 0.25 --presets $P $H --seed $seed --out $out ;;
    distractors-*) $PY niah --fact number --distractors --lengths $L --depths $DEPTHS --samples 2 --budgets 0.25 --presets $P $H --seed $seed --out $out ;;
    number-*) $PY niah --needle number --lengths $L --depths $DEPTHS --samples 2 --budgets 0.25 --presets $P $H --seed $seed --out $out ;;
    fidelity-*) $PY fidelity --prefix $L --continuation 256 --samples ${SAMPLES:-8} --budgets 0.5,0.25 --presets $P $H --seed $seed --out $out ;;
    agreement-*) $PY agreement --length $L --samples ${SAMPLES:-8} --new-tokens 64 --budgets 0.5,0.25 --presets $P $H --seed $seed --out $out ;;
    esac > $out.log 2>&1
    echo "== $step done rc=$? $(date +%T)" >> $O/aligned.log
done
