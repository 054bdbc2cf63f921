#!/bin/bash
# issue 18 target grid, session 9: kvzip-copy-heads-fitted beside the baselines, every method in ONE run per task
# (no seeded cells). Same commands as results/issue18-grid3 (SmolLM2-135M, PG essays 2k, depths 0.1-0.9,
# 10 samples per fact, keep 0.25; 0.5 and 0.25 for fidelity/agreement; question after compression unless said).
# --threads 1, nice 5, one process at a time. Resumable: rerunning skips finished cells.
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
M=${M:-snapkv,streamingllm,kvzip,kvzip-copy-heads-fitted}
C="--threads 1 --no-progress --no-plots --haystack $HAY"
O=results/issue18-grid4
D="--depths 0.1,0.3,0.5,0.7,0.9"
step=${1:-all}
if [ $step = all ] || [ $step = fidelity ]; then
$PY fidelity --prefix 1024 --continuation 256 --samples 4 --budgets 0.5,0.25 --presets $M $C --out $O/fidelity
fi
if [ $step = all ] || [ $step = agreement ]; then
$PY agreement --length 1024 --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $M $C --out $O/agreement
fi
if [ $step = all ] || [ $step = qa ]; then
$PY niah --fact number --distractors --lengths 2048 $D --samples 2 --budgets 0.25 --presets full,$M $C --out $O/distractors
$PY niah --fact code-word --lengths 2048 $D --samples 2 --budgets 0.25 --presets full,$M $C --out $O/word
$PY niah --needle number --lengths 2048 $D --samples 2 --budgets 0.25 --presets full,$M $C --out $O/number
fi
if [ $step = all ] || [ $step = aware ]; then
$PY niah --fact number --distractors --lengths 2048 $D --samples 2 --budgets 0.25 --protocols aware --presets full,$M $C --out $O/aware-distractors
fi
