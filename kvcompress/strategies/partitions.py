"""Bipartite splits of padded chunk segments into a source set A and a destination set B.

CSM merges A tokens into B tokens only, so a round can never merge more than |A| <= half of a
chunk, and B tokens stay representatives for the whole round (no chains to resolve).

Every partition puts floor(n / 2) members of a segment of n members into A and the rest into B:
    alternating  A = odd local indices, B = even ones (CentroidKV's choice: neighbours are the
                 most similar keys, and every A token has a B neighbour on each side)
    contiguous   A = the first half, B = the second half (ablation)
    random       a seeded random half (ablation)
"""

from __future__ import annotations

import torch
from torch import Tensor

PARTITIONS = ("alternating", "contiguous", "random")


def split_ab(mask: Tensor, partition: str, generator: torch.Generator | None = None) -> Tensor:
    """Which members of each segment form set A.

    mask:      [S, L] bool, real members of each padded segment (a prefix of each row)
    partition: one of PARTITIONS; "random" draws from ``generator`` (CPU)
    returns    is_a [S, L] bool (B = mask & ~is_a); each row has floor(n / 2) A members
    """
    S, L = mask.shape
    local = torch.arange(L, device=mask.device).expand(S, L)
    n_a = (mask.sum(1) // 2)[:, None]  # [S, 1]
    if partition == "alternating":
        return mask & (local % 2 == 1)
    if partition == "contiguous":
        return mask & (local < n_a)
    if partition == "random":
        noise = torch.rand(S, L, generator=generator).to(mask.device)
        noise = noise.masked_fill(~mask, 2.0)  # padding sorts last, never in A
        rank = noise.argsort(1).argsort(1)  # [S, L] rank of each member's draw
        return mask & (rank < n_a)
    raise ValueError(f"partition={partition!r} is invalid: expected one of {list(PARTITIONS)}")


def compact(members: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Local indices of the selected members of each segment, in order, left-aligned.

    members: [S, L] bool
    width:   columns to return (>= the most members of any row)
    returns  index [S, width] long (local slot, 0 where padded) and ok [S, width] bool
    """
    S, L = members.shape
    local = torch.arange(L, device=members.device)
    key = torch.where(members, local, local + L)  # selected first, each group in local order
    index = key.argsort(1)[:, :width]
    ok = torch.arange(width, device=members.device)[None, :] < members.sum(1, keepdim=True)
    return index.masked_fill(~ok, 0), ok
