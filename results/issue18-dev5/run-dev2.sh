#!/bin/bash
# dev (pydoc, seed 101, 3 windows of 1k + 256): fitted merger variants and the head split
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
F=kvzip-copy-heads-fitted
$PY fidelity --prefix 1024 --continuation 256 --samples 3 --budgets 0.5,0.25 --presets snapkv,kvzip-d2o-tokens,kvzip-copy-heads,$F $C \
  --method "$F:clusterer.threshold=-1" --method 'kvzip-copy-heads:guards=[{"name":"importance","params":{"share":0.8,"reduce":"median","surprisal":1.0,"token_share":0.15,"head_budget":"uniform","copy_heads":0.05,"other_token_share":0.5}}]' --method 'kvzip-copy-heads-fitted:guards=[{"name":"importance","params":{"share":0.8,"reduce":"median","surprisal":1.0,"token_share":0.15,"head_budget":"uniform","copy_heads":0.05,"other_token_share":0.5}}]' --out results/issue18-dev5/fidelity2
