#!/bin/bash
# Session 30: kvzip-copy-heads-layers-sentences beside the baselines on seeds no run had used (31+), one run per task:
# session 29's script with this folder and this preset.
# Usage: LEN=2048 bash results/issue18-s30/heldout.sh distractors-s32 number-s32 word-s32 fidelity-s32 agreement-s32
O=/work/main/results/issue18-s30 MAIN=kvzip-copy-heads-layers-sentences exec bash /work/main/results/issue18-s29/heldout.sh "$@"
