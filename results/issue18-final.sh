#!/bin/bash
# issue 18 final grid, run once on the PG essays (tuning was on pydoc text): SmolLM2-135M, question after
# compression, --threads 1, nice. Resumable: rerunning skips the finished cells. (The -tokens presets were
# added after the first word cells had run: the word directory was resumed with them.)
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
M=full,snapkv,kvzip,kvzip-adakv,kvzip-sentences,kvzip-csm,kvzip-d2o,kvzip-d2o-tokens,kvzip-csm-tokens
C="--threads 1 --no-progress --no-plots --haystack $HAY"
S=${SAMPLES:-1}
$PY niah --fact number --distractors --lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples $S --budgets 0.25 --presets $M $C --out results/issue18-niah-distractors
$PY fidelity --prefix 1024 --continuation 256 --samples 2 --budgets 0.5,0.25 --presets $M $C --out results/issue18-fidelity
$PY agreement --length 2048 --samples 2 --new-tokens 64 --budgets 0.5,0.25 --presets $M $C --out results/issue18-agreement
$PY niah --fact code-word --lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples $S --budgets 0.25 --presets $M $C --out results/issue18-niah-word
$PY niah --needle number --lengths 2048 --depths 0.1,0.3,0.5,0.7,0.9 --samples $S --budgets 0.25 --presets $M $C --out results/issue18-niah-number
