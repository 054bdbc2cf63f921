#!/bin/bash
# issue 18 target grid, session 6: SmolLM2-135M, PG essays 2k, depths 0.1-0.9, 10 samples per fact
# (--samples 2 x 5 depths), keep 0.25 (and 0.5 for fidelity/agreement), question after compression
# unless said. Baseline cells seeded from results/issue18-grid (seed.py; same samples and prompt
# hashes, the eval's resume checks them; a few rerun to check they reproduce: check.py).
# --threads 1, nice 5, one process at a time. Resumable: rerunning skips finished cells.
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
NEW=kvzip-sentences-surprisal,kvzip-hybrid
BASE=full,streamingllm,snapkv,kvzip,kvzip-sentences-median,kvzip-d2o-tokens
M=$BASE,$NEW
MW=streamingllm,snapkv,kvzip,kvzip-sentences-median,kvzip-d2o-tokens,$NEW
MA=full,snapkv,kvzip,kvzip-sentences-median,kvzip-d2o-tokens,semanticache-safe,centroidkv-safe,$NEW
C="--threads 1 --no-progress --no-plots --haystack $HAY"
O=results/issue18-grid2
D="--depths 0.1,0.3,0.5,0.7,0.9"
step=${1:-all}
if [ $step = all ] || [ $step = qa ]; then
$PY niah --fact code-word --lengths 2048 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/word
$PY niah --fact number --distractors --lengths 2048 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/distractors
$PY niah --needle number --lengths 2048 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/number
fi
if [ $step = all ] || [ $step = fidelity ]; then
$PY fidelity --prefix 1024 --continuation 256 --samples 4 --budgets 0.5,0.25 --presets $MW $C --out $O/fidelity
fi
if [ $step = all ] || [ $step = agreement ]; then
$PY agreement --length 1024 --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $M $C --out $O/agreement
fi
if [ $step = all ] || [ $step = aware ]; then
$PY niah --fact number --distractors --lengths 2048 $D --samples 2 --budgets 0.25 --protocols aware --presets $MA $C --out $O/aware-distractors
fi
