#!/bin/bash
# issue 18, session 10, dev only (pydoc_data.topics, seed 101, keep 0.25, question after compression):
# why kvzip-copy-heads-fitted loses facts at 4k. One prefill + one reconstruction pass per sample, every variant
# compressed from it (probe.py). Resumable (rows.jsonl). Usage: bash results/issue18-dev7/run.sh [step ...]
cd "$(dirname "$0")/../.."
S=${S:-2}  # samples per depth
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=$PWD /work/main/.venv/bin/python results/issue18-dev7/probe.py"
O=results/issue18-dev7
steps=${*:-word4k word2k dist4k}
for step in $steps; do
  case $step in
    word4k) $PY --length 4096 --samples $S --fact code-word --out $O/word-4k --dump ${DUMP:-/tmp/h18-dev7}/word-4k --snapshots ${DUMP:-/tmp/h18-dev7}/snap-word-4k ;;
    word2k) $PY --length 2048 --samples $S --fact code-word --out $O/word-2k --dump ${DUMP:-/tmp/h18-dev7}/word-2k --snapshots ${DUMP:-/tmp/h18-dev7}/snap-word-2k ;;
    dist4k) $PY --length 4096 --samples $S --fact number --distractors --out $O/distractors-4k --dump ${DUMP:-/tmp/h18-dev7}/distractors-4k --snapshots ${DUMP:-/tmp/h18-dev7}/snap-distractors-4k ;;
    dist2k) $PY --length 2048 --samples $S --fact number --distractors --out $O/distractors-2k ;;
  esac
done
