#!/bin/bash
# Session 31: session 29's held-out script with this folder; MAIN defaults to README command 1's preset.
# Usage: LEN=4096 bash results/issue18-s31/heldout.sh number-s33   (MAIN=... EXTRA=,... to add presets)
O=/work/main/results/issue18-s31 MAIN=${MAIN:-kvzip-copy-heads-layers-sentences} exec bash /work/main/results/issue18-s29/heldout.sh "$@"
