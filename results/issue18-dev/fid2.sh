#!/bin/bash
# dev tuning on pydoc text (not the PG essays of the final grid)
cd /work/wt/h18
G='{"name":"importance","params":'
HF_HUB_OFFLINE=1 nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval fidelity --prefix 1024 --continuation 256 \
  --samples 2 --budgets 0.5,0.25 --threads 1 --no-progress --no-plots --out results/issue18-dev/fid2 \
  --presets full,snapkv \
  --method "kvzip-csm:guards=[$G{\"share\":0.3,\"token_share\":0.2,\"window_share\":0.4}}],query_window=32" \
  --method "kvzip-csm:guards=[$G{\"share\":0.2,\"window_share\":0.7}}],query_window=32" \
  --method "kvzip-csm:guards=[$G{\"share\":0.3,\"window_share\":0.6}}],query_window=32" \
  --method "kvzip-sentences:guards=[$G{\"share\":0.3}}],query_window=32,recent=32,clusterer.scorer={\"name\":\"snapkv\",\"params\":{\"kernel_size\":7}}"
