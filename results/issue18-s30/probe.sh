#!/bin/bash
# Session 30 probe (spent windows: seed 30, 4k, depth 0.9, where the planted number missed twice with the needle's
# sentence held): is it the merging of the needle's left-out tokens in the other heads? Usage: bash results/issue18-s30/probe.sh NAME ARGS...
O=/work/main/results/issue18-s30
name=$1; shift; out=$O/probe/$name
echo "== probe $name start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/main rev-parse --short HEAD) args $*" >> $O/runs.log
nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval niah --needle number --protocols agnostic \
    --lengths 4096 --depths 0.9 --samples 2 --budgets 0.25 --threads 1 --no-progress --no-plots \
    --haystack /work/shared/data/paul_graham_essays --seed 30 --out $out "$@" > $out.log 2>&1
echo "== probe $name done rc=$? $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $O/runs.log
