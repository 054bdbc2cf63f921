#!/bin/bash
# SemantiCache below its anchor floor (issue 15): the preset's levels (paper chunks where they reach
# the budget; else clauses with mergeable delimiters; else runs of clauses joined; else, for short
# prompts, sinks + recent window shrunk to half the budget) vs the paper's chunking alone
# (fallback_chunker=null: best effort, floored ~0.3) vs fixed 64-token chunks.
# SmolLM2-135M-Instruct, Paul Graham essays, 1 thread, CPU, machine shared with other jobs.
set -e
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
PY=${PY:-/work/main/.venv/bin/python}
OUT=results/semanticache-below-floor
METHODS="full,semanticache,semanticache:fallback_chunker=null,semanticache-fixed64"
HAY=/work/shared/data/paul_graham_essays
# 1000-token prefixes: 0.25 and 0.2 land on the clause level, 0.1 on joined clauses
$PY -m kvcompress.cli eval fidelity --haystack $HAY --prefix 1000 --continuation 200 --samples 6 \
    --presets $METHODS --budgets 0.25,0.2,0.1 --threads 1 --no-progress --out $OUT/fidelity
# 128-token prefixes: 4 + 32 protected slots exceed a quarter of them (the window level)
$PY -m kvcompress.cli eval fidelity --haystack $HAY --prefix 128 --continuation 64 --samples 6 \
    --presets $METHODS --budgets 0.25,0.2 --threads 1 --no-progress --out $OUT/fidelity-short
$PY -m kvcompress.cli eval niah --haystack $HAY --lengths 1024,2048 --depths 0.2,0.5,0.8 --samples 1 \
    --presets $METHODS --budgets 0.25,0.2 --threads 1 --no-progress --out $OUT/niah
