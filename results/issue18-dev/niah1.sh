#!/bin/bash
# dev NIAH on pydoc text (default haystack; not the PG essays of the final grid), question after compression
cd /work/wt/h18
G='{"name":"importance","params":'
S='clusterer.scorer={"name":"snapkv","params":{"kernel_size":7}},clusterer.recent_share=0,query_window=32,track_attention=false,sinks=4,recent=32'
for FACT in "--fact code-word" "--fact number --distractors"; do
OUT=results/issue18-dev/niah1-$(echo $FACT | tr -d ' -')
HF_HUB_OFFLINE=1 nice -n 5 /work/main/.venv/bin/python -m kvcompress.cli eval niah $FACT --lengths 2048 --depths 0.1,0.5,0.9 \
  --samples 1 --budgets 0.25 --threads 1 --no-progress --no-plots --out $OUT \
  --presets full,snapkv,kvzip,kvzip-sentences,kvzip-csm \
  --method "d2o-prop:$S" \
  --method "d2o-prop:$S,guards=[$G{\"share\":0.2}}]" \
  --method "d2o-prop:$S,guards=[$G{\"share\":0.4}}]"
done
