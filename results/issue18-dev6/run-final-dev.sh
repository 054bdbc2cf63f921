#!/bin/bash
# dev (pydoc, seed 101, 1k, number among distractors, both protocols): the session-9 kvzip-copy-heads-fitted
# (adaptive split, query_share 0.2 read in the top-0.1 copy heads over the free slots); kvzip-copy-heads seeded from dev5
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
$PY niah --fact number --distractors --lengths 1024 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 --protocols agnostic,aware \
  --presets kvzip-copy-heads,kvzip-copy-heads-fitted $C --out results/issue18-dev6/distractors2
