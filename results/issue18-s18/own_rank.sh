#!/bin/bash
# issue 18, session 18 (diagnosis only): own_rank.py on the depth-0.9 misses and one depth-0.7 twin.
# Usage: bash results/issue18-s18/own_rank.sh
cd /work/main
O=results/issue18-s18
for spec in "09-number-2k-s0-1:--depth 0.9 --kind number --sample 1 --seed 0" \
            "09-distractors-2k-s0-1:--depth 0.9 --kind number-fact --distractors --sample 1 --seed 0" \
            "07-number-2k-s0-1:--depth 0.7 --kind number --sample 1 --seed 0" \
            "09-word-2k-s1-0:--depth 0.9 --kind code-word --sample 0 --seed 1"; do
    name=${spec%%:*}; args=${spec#*:}
    nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/main .venv/bin/python $O/own_rank.py --preset kvzip-copy-heads-lead \
        --length 2048 $args > $O/ownrank$name.json 2> $O/ownrank$name.err
done
