#!/bin/bash
# after the final grid: reconstruction cost (task 3), then the README demo question-free at keep 0.25 (task 4)
cd /work/wt/h18
while kill -0 12074 2>/dev/null; do sleep 5; done
HF_HUB_OFFLINE=1 nice -n 5 /work/main/.venv/bin/python results/issue18-cost/measure.py --lengths 2048 --reps 1 > results/issue18-cost/measure.log 2>&1
mkdir -p results/issue18-demo
for P in kvzip-d2o-tokens kvzip; do
  HF_HUB_OFFLINE=1 nice -n 5 /work/main/.venv/bin/python -c "import torch; torch.set_num_threads(1); from kvcompress import cli; raise SystemExit(cli.main(['demo', '--budget', '0.25', '--preset', '$P', '--json']))" > results/issue18-demo/$P.json 2> results/issue18-demo/$P.log
done
