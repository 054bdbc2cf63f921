#!/bin/bash
# dev for the fitted merger on the copy-heads layout (issue 18, session 8): pydoc_data.topics, seed 101,
# 1k tokens, as results/issue18-dev4/run-dev.sh (never the PG grid's text or needles).
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
O=results/issue18-dev5
D="--depths 0.1,0.3,0.5,0.7,0.9"
F=kvzip-copy-heads-fitted
step=${1:-fidelity}
if [ $step = fidelity ]; then
$PY fidelity --prefix 1024 --continuation 256 --samples ${S:-3} --budgets 0.5,0.25 --presets snapkv,kvzip-copy-heads,$F $C \
  --method "$F:clusterer.threshold=-1" --method "$F:merger.queries=reconstruction" \
  --method "$F:merger.queries=window+reconstruction" --out $O/fidelity
fi
if [ $step = distractors ]; then
$PY niah --fact number --distractors --lengths 1024 $D --samples 2 --budgets 0.25 --presets kvzip-copy-heads,${M:-$F} $C --out $O/distractors
fi
