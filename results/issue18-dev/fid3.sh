#!/bin/bash
# dev tuning on pydoc text (not the PG essays of the final grid): eviction + merging of the evicted (D2O-style)
cd /work/wt/h18
G='{"name":"importance","params":'
S='clusterer.scorer={"name":"snapkv","params":{"kernel_size":7}},clusterer.recent_share=0,query_window=32,track_attention=false,sinks=4,recent=32'
HF_HUB_OFFLINE=1 nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval fidelity --prefix 1024 --continuation 256 \
  --samples 2 --budgets 0.5,0.25 --threads 1 --no-progress --no-plots --out results/issue18-dev/fid3 \
  --presets full,snapkv \
  --method "d2o-prop:$S" \
  --method "d2o-prop:$S,guards=[$G{\"share\":0.3}}]" \
  --method "d2o-prop:$S,merger.threshold=0.5,guards=[$G{\"share\":0.3}}]"
