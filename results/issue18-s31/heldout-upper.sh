#!/bin/bash
# Session 31 held-out: kvzip-copy-heads-upper beside kvzip-copy-heads-layers-sentences (README command 1's) and the
# baselines, on seeds no run had used (34 at 4k, 35 at 2k), one run per task.
#   bash results/issue18-s31/heldout-upper.sh 4k    # planted number, fidelity, distractors at 4k (seed 34)
#   bash results/issue18-s31/heldout-upper.sh 2k    # fidelity, agreement, facts, query-aware at 2k (seed 35)
S=/work/main/results
export MAIN=kvzip-copy-heads-upper EXTRA=,kvzip-copy-heads-layers-sentences AWARE=kvzip-copy-heads-upper
case $1 in
4k) LEN=4096 bash $S/issue18-s31/heldout.sh number-s34
    SEED=34 O=$S/issue18-s31 PRESETS=snapkv,kvzip,kvzip-copy-heads-layers-sentences,kvzip-copy-heads-upper \
        bash $S/issue18-s29/run4k.sh fidelity
    LEN=4096 bash $S/issue18-s31/heldout.sh distractors-s34 ;;
2k) LEN=2048 bash $S/issue18-s31/heldout.sh fidelity-s35 agreement-s35 distractors-s35 number-s35 word-s35 aware-s35 ;;
*) echo "heldout-upper.sh: length=$1 is invalid: expected 4k or 2k" >&2; exit 2 ;;
esac
