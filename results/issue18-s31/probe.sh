#!/bin/bash
# Session 31 dev probe on spent windows (seed 30, 4k, depth 0.9, planted number: the preset's two misses).
# Usage: bash results/issue18-s31/probe.sh NAME --method FILE.json ...
O=/work/main/results/issue18-s31
name=$1; shift; out=$O/probe/$name; mkdir -p $O/probe
echo "== probe $name start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD)+wip args $*" >> $O/runs.log
nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval niah --needle number --protocols agnostic \
    --lengths ${LEN:-4096} --depths ${DEPTHS:-0.9} --samples 2 --budgets 0.25 --threads 1 --no-progress --no-plots \
    --haystack /work/shared/data/paul_graham_essays --seed ${SEED:-30} --out $out "$@" > $out.log 2>&1
echo "== probe $name done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
