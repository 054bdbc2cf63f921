#!/bin/bash
# Sessions 29-30: fidelity or agreement at 4k, 4 windows, kvzip-copy-heads-layers-sentences beside SnapKV and kvzip only
# (time; PRESETS overrides the list). SEED and O (the output folder) default to session 29's run (seed 30).
# Usage: SEED=31 O=/work/main/results/issue18-s30 bash results/issue18-s29/run4k.sh fidelity|agreement
O=${O:-/work/main/results/issue18-s29}
SEED=${SEED:-30}
task=$1
case $task in
fidelity) args="fidelity --prefix 4096 --continuation 256" ;;
agreement) args="agreement --length 4096 --new-tokens 64" ;;
*) echo "run4k.sh: task=$task is invalid: expected fidelity or agreement" >&2; exit 2 ;;
esac
label=${task:0:3}4k  # fid4k / agr4k, as runs.log names them
out=$O/heldout-$task-4k-s$SEED
echo "== $label start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)" >> $O/runs.log
nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval $args \
    --samples 4 --presets ${PRESETS:-snapkv,kvzip,kvzip-copy-heads-layers-sentences} --budgets 0.5,0.25 --threads 1 --no-progress \
    --no-plots --haystack /work/shared/data/paul_graham_essays --seed $SEED --out $out > $out.log 2>&1
echo "== $label done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
