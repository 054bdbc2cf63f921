#!/bin/bash
# issue 18 target grid, session 10: the 4k half of the targets (session 9's grid4 is the 2k half), plus fidelity and
# generation agreement at the issue's context lengths (2k, 4k; grid4 used 1024-token prefixes).
# Preset code as on main 687849f (kvzip-copy-heads-fitted unchanged since grid4). Every method in ONE run per task,
# nothing seeded; SmolLM2-135M, PG essays, depths 0.1-0.9, 10 samples per fact, keep 0.25 (facts) and 0.5/0.25
# (fidelity, agreement); question after compression unless said. --threads 1, nice 5, resumable.
# Session 10 order (run.log): word (all methods), fidelity2k, agreement2k, then distractors, number, aware with
# M=snapkv,streamingllm,kvzip-copy-heads-fitted (kvzip left out for time), fidelity4k stopped unfinished at the session end.
# Usage: bash results/issue18-grid5/run.sh [word|distractors|number|aware|fidelity2k|agreement2k|fidelity4k|agreement4k|all]
SRC=${SRC:-/work/wt/grid}
cd "$SRC"
OUTROOT=${OUTROOT:-/work/main/results/issue18-grid5}
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$SRC /work/main/.venv/bin/python -m kvcompress.cli eval"
HAY=/work/shared/data/paul_graham_essays
M=${M:-snapkv,streamingllm,kvzip,kvzip-copy-heads-fitted}
C="--threads 1 --no-progress --no-plots --haystack $HAY"
O=$OUTROOT
D="--depths 0.1,0.3,0.5,0.7,0.9"
step=${1:-all}
run() { [ $step = all ] || [ $step = $1 ]; }
run word && $PY niah --fact code-word --lengths 4096 $D --samples 2 --budgets 0.25 --presets full,$M $C --out $O/word-4k
run distractors && $PY niah --fact number --distractors --lengths 4096 $D --samples 2 --budgets 0.25 --presets full,$M $C --out $O/distractors-4k
run number && $PY niah --needle number --lengths 4096 $D --samples 2 --budgets 0.25 --presets full,$M $C --out $O/number-4k
run aware && $PY niah --fact number --distractors --lengths 4096 $D --samples 2 --budgets 0.25 --protocols aware --presets full,$M $C --out $O/aware-distractors-4k
run fidelity2k && $PY fidelity --prefix 2048 --continuation 256 --samples 4 --budgets 0.5,0.25 --presets $M $C --out $O/fidelity-2k
run agreement2k && $PY agreement --length 2048 --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $M $C --out $O/agreement-2k
run fidelity4k && $PY fidelity --prefix 4096 --continuation 256 --samples 4 --budgets 0.5,0.25 --presets $M $C --out $O/fidelity-4k
run agreement4k && $PY agreement --length 4096 --samples 4 --new-tokens 64 --budgets 0.5,0.25 --presets $M $C --out $O/agreement-4k
true
