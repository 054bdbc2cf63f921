# The guard variants of kvzip-copy-heads-aligned that session 23's scripts run (sourced by diag.sh and dev_agree.sh):
#   Q0:  query_share 0 (the whole sentences' allowance by the importance + surprisal ranking)
#   ALL: share 1.0, token_share 0, query_share 0 (the copy heads hold sentences only; other heads unchanged)
G='"reduce":"median","surprisal":1.0,"head_budget":"adaptive","copy_heads":0.05,"other_token_share":0.5,"query_heads":0.1,"band":512,"allowance_keep":0.25,"lead":32,"aligned":true'
Q0="kvzip-copy-heads-aligned:guards=[{\"name\":\"importance\",\"params\":{\"share\":0.8,\"token_share\":0.15,\"query_share\":0.0,$G}}]"
ALL="kvzip-copy-heads-aligned:guards=[{\"name\":\"importance\",\"params\":{\"share\":1.0,\"token_share\":0.0,\"query_share\":0.0,$G}}]"
