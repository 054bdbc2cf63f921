#!/bin/bash
# issue 18, session 18: the depth-0.9 misses (diagnosis only): where the needle's sentences stand in the importance
# guard's ranking, kvzip-copy-heads-lead at keep 0.25 (results/issue18-s17dev/band_profile.py), and the same samples
# at depth 0.7 (no miss there in any seed) beside them. Output: probeDD-TASK-sSEED-SAMPLE.json (stderr in .err).
# Usage: SRC=<checkout of main> bash results/issue18-s18/probe09.sh 0.9|0.7
SRC=${SRC:-/work/main}
O=/work/main/results/issue18-s18
DEPTH=${1:-0.9}
cd "$SRC"
run() {  # name, band_profile arguments
    f=$O/probe${DEPTH/./}-$1
    nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python results/issue18-s17dev/band_profile.py \
        --preset kvzip-copy-heads-lead --depth $DEPTH "${@:2}" 2>$f.err > $f.json
}
run number-2k-s0-1 --kind number --length 2048 --sample 1 --seed 0
run distractors-2k-s0-1 --kind number-fact --distractors --length 2048 --sample 1 --seed 0
run distractors-2k-s0-0 --kind number-fact --distractors --length 2048 --sample 0 --seed 0
run word-2k-s1-0 --kind code-word --length 2048 --sample 0 --seed 1
