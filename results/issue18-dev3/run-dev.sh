#!/bin/bash
# dev QA + fidelity on pydoc_data.topics (seed 101, 1k tokens; never the PG grid's text or needles):
# the new presets beside the best previous ones, and the hybrid's sentence/token split.
# Variant configs: results/issue18-dev3/hyb-s{S}-t{T}.json (run from /tmp/h18cfg, same files) = _d2o(importance_guard(S, reduce="median",
# surprisal=1.0, token_share=T, head_budget="adaptive")) of kvcompress/presets/importance.py, as PipelineConfig.to_dict().
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
O=results/issue18-dev3
D="--depths 0.1,0.3,0.5,0.7,0.9"
V=results/issue18-dev3/hyb-s0.6-t0.3.json,results/issue18-dev3/hyb-s0.8-t0.15.json,results/issue18-dev3/hyb-s0.4-t0.4.json
M=kvzip-sentences-median,kvzip-sentences-surprisal,kvzip-d2o-tokens,$V
step=${1:-all}
if [ $step = all ] || [ $step = qa ]; then
$PY niah --fact code-word --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/word
$PY niah --fact number --distractors --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/distractors
$PY niah --needle number --lengths 1024 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/number
fi
if [ $step = all ] || [ $step = fidelity ]; then
$PY fidelity --prefix 1024 --continuation 256 --samples 3 --budgets 0.5,0.25 --presets $M $C --out $O/fidelity
fi
