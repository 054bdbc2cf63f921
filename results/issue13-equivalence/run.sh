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
# semanticache's fallback chunker (the budget work merged between the two commits, an intended
# change: budgets below the delimiter chunker's floor are now met) switched off, to compare the
# cells where it acts (semanticache at keep 0.25) with the code before it
cd "$NEW"
NF="--presets semanticache --budgets 0.25 --override fallback_chunker=null --threads 1 --no-plots --no-progress"
[ -f "$OUT/new-nofallback/niah/results.json" ] || nice -n 5 $PY -m kvcompress.cli eval niah --haystack $HAY \
    --lengths 2048 --depths 0.3,0.7 --samples 1 --protocols agnostic $NF --out "$OUT/new-nofallback/niah"
[ -f "$OUT/new-nofallback/niah-protect/results.json" ] || nice -n 5 $PY -m kvcompress.cli eval niah --haystack $HAY \
    --lengths 2048 --depths 0.5 --samples 1 --protect-needle --protocols agnostic $NF --out "$OUT/new-nofallback/niah-protect"
[ -f "$OUT/new-nofallback/fidelity/results.json" ] || nice -n 5 $PY -m kvcompress.cli eval fidelity --haystack $HAY \
    --prefix 1000 --continuation 100 --samples 1 $NF --out "$OUT/new-nofallback/fidelity"
cd "$HERE"
$PY compare.py "$OUT" > compare.json || true
mkdir -p records && for t in base new new-nofallback; do for r in niah niah-protect fidelity; do
  cp "$OUT/$t/$r/cells.jsonl" "records/$t-$r.jsonl"; done; done
[ "${SPEED:-1}" = 0 ] || [ -f speed.json ] || nice -n 5 $PY speed.py --base "$BASE" --new "$NEW" --rounds 2 --out speed.json
