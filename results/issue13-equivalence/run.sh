#!/usr/bin/env bash
# Issue 13 item 2: the same NIAH slice, oracle-protected NIAH and fidelity run with the code before
# the redesign (471d008, worktree $BASE) and after (this branch, worktree $NEW), then the records
# compared (compare.py) and decode TPOT / compression time measured alternately (speed.py).
# Resumable: a finished run (its results.json present) is not repeated. One thread per run.
set -euo pipefail
BASE=${BASE:-/work/wt/h13-base}
NEW=${NEW:-/work/wt/h13}
PY=${PY:-/work/main/.venv/bin/python}
OUT=${OUT:-/tmp/issue13-eq}
HAY=/work/shared/data/paul_graham_essays
HERE=$(cd "$(dirname "$0")" && pwd)
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
for tree in base new; do
  dir=$BASE; [ "$tree" = new ] && dir=$NEW
  cd "$dir"
  [ -f "$OUT/$tree/niah/results.json" ] || nice -n 5 $PY -m kvcompress.cli eval niah --haystack $HAY \
      --lengths 2048 --depths 0.3,0.7 --samples 1 \
      --presets full,semanticache,centroidkv,streamingllm,snapkv,semanticache-safe \
      --budgets 0.5,0.25 --protocols agnostic --threads 1 --no-plots --no-progress --out "$OUT/$tree/niah"
  [ -f "$OUT/$tree/niah-protect/results.json" ] || nice -n 5 $PY -m kvcompress.cli eval niah --haystack $HAY \
      --lengths 2048 --depths 0.5 --samples 1 --presets semanticache,centroidkv --protect-needle \
      --budgets 0.25 --protocols agnostic --threads 1 --no-plots --no-progress --out "$OUT/$tree/niah-protect"
  [ -f "$OUT/$tree/fidelity/results.json" ] || nice -n 5 $PY -m kvcompress.cli eval fidelity --haystack $HAY \
      --prefix 1000 --continuation 100 --samples 1 \
      --presets semanticache,centroidkv,semanticache-safe \
      --budgets 0.5,0.25 --threads 1 --no-plots --no-progress --out "$OUT/$tree/fidelity"
done
cd "$HERE"
$PY compare.py "$OUT" > compare.json || true
[ "${SPEED:-1}" = 0 ] || [ -f speed.json ] || nice -n 5 $PY speed.py --base "$BASE" --new "$NEW" --rounds 2 --out speed.json
