#!/bin/bash
# dev (pydoc, seed 101, 1k): number among distractors, question after compression and inside the prompt;
# the guard's query_share (sentences picked first by the window queries' attention)
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
F=kvzip-copy-heads-fitted
$PY niah --fact number --distractors --lengths 1024 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 --protocols aware,agnostic \
  --presets kvzip-copy-heads,$F $C --method 'kvzip-copy-heads-fitted:guards=[{"name":"importance","params":{"share":0.8,"reduce":"median","surprisal":1.0,"token_share":0.15,"head_budget":"uniform","copy_heads":0.05,"other_token_share":0.5,"query_share":0.25}}]' --out results/issue18-dev5/distractors
