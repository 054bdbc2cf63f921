#!/bin/bash
# SemantiCache below its anchor floor (issue 15): the fallback chunker (delimiter anchors="merge")
# vs the paper's chunking alone (fallback_chunker=null: best effort, floored ~0.28) vs fixed 64-token
# chunks, at keep 0.25 and 0.2, SmolLM2-135M-Instruct, Paul Graham essays, 1 thread, CPU.
set -e
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
PY=${PY:-/work/main/.venv/bin/python}
METHODS="full,semanticache,semanticache:fallback_chunker=null,semanticache-fixed64"
HAY=/work/shared/data/paul_graham_essays
$PY -m kvcompress.cli eval fidelity --haystack $HAY --prefix 1000 --continuation 200 --samples 3 \
    --presets $METHODS --budgets 0.25,0.2 --threads 1 --no-progress --out results/semanticache-below-floor/fidelity
$PY -m kvcompress.cli eval niah --haystack $HAY --lengths 2048 --depths 0.2,0.5,0.8 --samples 1 \
    --presets $METHODS --budgets 0.25,0.2 --threads 1 --no-progress --out results/semanticache-below-floor/niah
