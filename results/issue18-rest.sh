#!/bin/bash
# the rest of issue18-final.sh, reordered so that the cost measurement (task 3) runs before the
# planted-number grid; then the README demo question-free at keep 0.25 (task 4)
cd /work/wt/h18
while kill -0 15964 2>/dev/null; do sleep 5; done   # the agreement run of issue18-final.sh
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
M=full,snapkv,kvzip,kvzip-adakv,kvzip-sentences,kvzip-csm,kvzip-d2o,kvzip-d2o-tokens,kvzip-csm-tokens
C="--threads 1 --no-progress --no-plots --haystack $HAY"
$PY niah --fact code-word --lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 1 --budgets 0.25 --presets $M $C --out results/issue18-niah-word
HF_HUB_OFFLINE=1 nice -n 5 /work/main/.venv/bin/python results/issue18-cost/measure.py --lengths 2048 --reps 1 > results/issue18-cost/measure.log 2>&1
mkdir -p results/issue18-demo
for P in kvzip-d2o-tokens kvzip; do
  HF_HUB_OFFLINE=1 nice -n 5 /work/main/.venv/bin/python -c "import torch; torch.set_num_threads(1); from kvcompress import cli; raise SystemExit(cli.main(['demo', '--budget', '0.25', '--preset', '$P', '--json']))" > results/issue18-demo/$P.json 2> results/issue18-demo/$P.log
done
$PY niah --needle number --lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples 1 --budgets 0.25 --presets $M $C --out results/issue18-niah-number
