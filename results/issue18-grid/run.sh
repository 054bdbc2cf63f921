#!/bin/bash
# issue 18 target grid (session 5): SmolLM2-135M, PG essays, question after compression unless said,
# --threads 1, nice 5, one process at a time. Resumable: rerunning skips finished cells.
# The QA directories were seeded with the session-4 cells of the 5 samples s0 (same sample ids and
# prompt hashes; one sample, word d0.5 s0, left out and rerun to check that they reproduce).
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
EXTRA=${EXTRA-,kvzip-sentences-median,kvzip-d2o-median}   # presets from the dev work (results/issue18-dev2)
M=full,streamingllm,snapkv,kvzip,kvzip-adakv,kvzip-sentences,kvzip-d2o-tokens,kvzip-csm-tokens$EXTRA
MW=$M,kvzip-d2o,kvzip-csm
MG=full,streamingllm,snapkv,kvzip,kvzip-sentences,kvzip-d2o-tokens$EXTRA
MA=full,snapkv,kvzip,kvzip-d2o-tokens$EXTRA
C="--threads 1 --no-progress --no-plots --haystack $HAY"
O=results/issue18-grid
D="--depths 0.1,0.3,0.5,0.7,0.9"
step=${1:-all}
if [ $step = all ] || [ $step = fidelity ]; then
$PY fidelity --prefix 1024 --continuation 256 --samples 4 --budgets 0.5,0.25 --presets $MW $C --out $O/fidelity
fi
if [ $step = all ] || [ $step = qa ]; then
$PY niah --fact code-word --lengths 2048 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/word
$PY niah --fact number --distractors --lengths 2048 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/distractors
$PY niah --needle number --lengths 2048 $D --samples 2 --budgets 0.25 --presets $M $C --out $O/number
fi
if [ $step = all ] || [ $step = agreement ]; then
$PY agreement --length 1024 --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $MG $C --out $O/agreement
fi
if [ $step = all ] || [ $step = aware ]; then
$PY niah --fact number --distractors --lengths 2048 $D --samples 2 --budgets 0.25 --protocols aware --presets $MA $C --out $O/aware-distractors
fi
