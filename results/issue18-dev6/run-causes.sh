#!/bin/bash
# dev (pydoc_data.topics, seed 101, 1k, number among distractors, question after compression): which part of
# kvzip-copy-heads-fitted costs facts. Cells of kvzip-copy-heads / kvzip-copy-heads-fitted seeded from issue18-dev5.
#   F1 = kvzip-copy-heads + fitted merger only (same d2o clusters: every proposal merges)
#   F2 = F1 with clusterer d2o-similar (D2O's test in the plan; guard as kvzip-copy-heads, adaptive)
#   U  = kvzip-copy-heads with the uniform head split only (d2o merger)
#   kvzip-copy-heads-fitted = F2 + uniform split
cd /work/wt/h18
PY="nice -n 5 env HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/h18 /work/main/.venv/bin/python -m kvcompress.cli eval"
C="--threads 1 --no-progress --no-plots --seed 101"
FM='merger={"name":"fitted","params":{"queries":"window","reference_queries":32}}'
CS='{"name":"d2o-similar","params":{"scorer":{"name":"snapkv","params":{"kernel_size":7,"pooling":"max"}},"recent_share":0.0,"threshold":null}}'
G='{"share":0.8,"reduce":"median","surprisal":1.0,"token_share":0.15,"copy_heads":0.05,"other_token_share":0.5'
$PY niah --fact number --distractors --lengths 1024 --depths 0.1,0.3,0.5,0.7,0.9 --samples 2 --budgets 0.25 --protocols agnostic \
  --presets kvzip-copy-heads,kvzip-copy-heads-fitted $C \
  --method "kvzip-copy-heads:$FM" \
  --method "kvzip-copy-heads:$FM,clusterer=$CS" \
  --method "kvzip-copy-heads:guards=[{\"name\":\"importance\",\"params\":$G,\"head_budget\":\"uniform\"}}]" \
  --out results/issue18-dev6/distractors
