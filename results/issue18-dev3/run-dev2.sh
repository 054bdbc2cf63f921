#!/bin/bash
# second dev step (pydoc, seed 101, 1k): the hybrid with more of the budget to sentences, beside
# the best of run-dev.sh; variants as there (hyb-s{S}-t{T}.json).
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
O=results/issue18-dev3
D="--depths 0.1,0.3,0.5,0.7,0.9"
V=results/issue18-dev3/hyb-s0.8-t0.15.json,results/issue18-dev3/hyb-s0.9-t0.05.json,results/issue18-dev3/hyb-s1.0-t0.0.json
M=kvzip-sentences-median,kvzip-sentences-surprisal,kvzip-d2o-tokens,$V
$PY fidelity --prefix 1024 --continuation 256 --samples 3 --budgets 0.5,0.25 --presets $M $C --out $O/fidelity
$PY niah --fact number --distractors --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/distractors
$PY niah --needle number --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/number
