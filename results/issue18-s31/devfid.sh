#!/bin/bash
# Session 31 dev: fidelity (KL) of upper_share variants beside the preset on spent windows.
# Usage: LEN=2048 SEED=23 bash results/issue18-s31/devfid.sh NAME METHOD...
O=/work/main/results/issue18-s31
name=$1; shift; out=$O/dev/$name; mkdir -p $O/dev
M=""; for m in "$@"; do M="$M --method $m"; done
echo "== devfid $name start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)+wip args $*" >> $O/runs.log
nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval fidelity --prefix ${LEN:-2048} --continuation 256 \
    --samples ${SAMPLES:-8} $M --budgets 0.5,0.25 --threads 1 --no-progress --no-plots \
    --haystack /work/shared/data/paul_graham_essays --seed ${SEED:-23} --out $out > $out.log 2>&1
echo "== devfid $name done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
