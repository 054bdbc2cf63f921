#!/usr/bin/env bash
# Issue 16 item 2 measurements (one at a time, one thread, nice 5); resumable. From the repo root.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-/work/main/.venv/bin/python}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD  # this tree's kvcompress (a script's own directory comes first otherwise)
nice -n 5 $PY results/issue16-chunked/rss.py --out results/issue16-chunked/rss.json
nice -n 5 $PY results/issue16-chunked/quality.py --out results/issue16-chunked/quality.json
