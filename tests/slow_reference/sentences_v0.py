"""The sentence guard's query signal before the speed work (issue 16, session 5): the future mask
built and applied over every slot. Kept verbatim as the reference the tail-masked version is
tested against."""

import math
from typing import Sequence

import torch
from torch import Tensor

from kvcompress.strategies.sentences import per_head_max, slot_sentences
from kvcompress.types import KVState


def query_signal(states: Sequence[KVState], sid: Tensor, num: int, skip_layers: int = 2) -> Tensor:
    out = torch.zeros(sid.shape[0], num, dtype=torch.float32, device=sid.device)
    use = list(states[skip_layers:]) or list(states)
    for st in use:
        q = st.extras.get("queries")
        B, Hq, W, D = q.shape
        H, N = st.num_heads, st.num_slots
        G = Hq // H
        logits = torch.einsum("bhgwd,bhnd->bhgwn", q.reshape(B, H, G, W, D).float(), st.keys.float())
        logits.div_(math.sqrt(D)).add_(st.log_sizes[:, :, None, None, :])  # [B, H, G, W, N]
        qpos = st.num_tokens - W + torch.arange(W, device=q.device)  # [W]
        future = st.positions[:, :, None, None, :] > qpos[None, None, None, :, None]
        probs = torch.softmax(logits.masked_fill_(future, float("-inf")), -1).nan_to_num_(0.0)
        per_slot = probs.amax(dim=(2, 3))  # [B, H, N]
        out += per_head_max(per_slot, slot_sentences(st, sid), num).sum(1)
    return out
