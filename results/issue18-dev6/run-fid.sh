#!/bin/bash
# dev fidelity (pydoc, seed 101, 3 windows of 1k + 256): the fit with D2O's test on kvzip-copy-heads' layout (adaptive split),
# 32 or 64 window queries
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
CS='{"name":"d2o-similar","params":{"scorer":{"name":"snapkv","params":{"kernel_size":7,"pooling":"max"}},"recent_share":0.0,"threshold":null}}'
$PY fidelity --prefix 1024 --continuation 256 --samples 3 --budgets 0.5,0.25 --presets kvzip-copy-heads $C \
  --method "kvzip-copy-heads:merger={\"name\":\"fitted\",\"params\":{\"queries\":\"window\",\"reference_queries\":32}},clusterer=$CS" \
  --method "kvzip-copy-heads:merger={\"name\":\"fitted\",\"params\":{\"queries\":\"window\",\"reference_queries\":64}},clusterer=$CS,query_window=64" \
  --out results/issue18-dev6/fidelity
