# guard variants of kvzip-copy-heads-banded (session 14): allowances at keep 0.5 cut towards what keep 0.25 gives
g() { echo "kvzip-copy-heads-banded:guards=[{\"name\":\"importance\",\"params\":{\"share\":$1,\"reduce\":\"median\",\"surprisal\":1.0,\"token_share\":$2,\"head_budget\":\"adaptive\",\"copy_heads\":0.05,\"other_token_share\":$3,\"query_share\":0.2,\"query_heads\":0.1,\"band\":512}}]"; }
HALF=$(g 0.4 0.075 0.25); SENT=$(g 0.4 0.15 0.5); OTHER=$(g 0.8 0.15 0.25)
