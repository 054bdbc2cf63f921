#!/bin/bash
# dev for the copy-head split (issue 18, session 7): pydoc_data.topics, seed 101, 1k tokens, as
# results/issue18-dev3/run-dev.sh (never the PG grid's text or needles). Configs: make_configs.py.
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
O=results/issue18-dev4
D="--depths 0.1,0.3,0.5,0.7,0.9"
M=${M:-$O/copy-s0.8-t0.15-c0.25-o0.5.json,$O/copy-s0.8-t0.15-c0.1-o0.5.json,$O/copy-s0.8-t0.15-c0.5-o0.5.json}
step=${1:-all}
if [ $step = all ] || [ $step = distractors ]; then
$PY niah --fact number --distractors --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/distractors
fi
if [ $step = all ] || [ $step = fidelity ]; then
$PY fidelity --prefix 1024 --continuation 256 --samples 3 --budgets 0.5,0.25 --presets $M $C --out $O/fidelity
fi
if [ $step = all ] || [ $step = qa ]; then
$PY niah --fact code-word --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/word
$PY niah --needle number --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/number
fi
if [ $step = agreement ]; then
$PY agreement --length 1024 --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $M $C --out $O/agreement
fi
