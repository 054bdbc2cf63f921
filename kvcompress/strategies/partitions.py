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


def ab_indices(mask: Tensor, partition: str, generator: torch.Generator | None = None):
    """Local indices of each segment's A and B members, left-aligned.

    mask:    [S, L] bool, real members (a prefix of each row)
    returns  a_idx [S, L // 2], a_ok [S, L // 2], b_idx [S, (L + 1) // 2], b_ok [S, (L + 1) // 2]
             (index 0 where not ok); members keep their chunk order inside A and inside B
    """
    S, L = mask.shape
    device = mask.device
    n = mask.sum(1, keepdim=True)  # [S, 1]
    ja = torch.arange(L // 2, device=device)[None, :]
    jb = torch.arange((L + 1) // 2, device=device)[None, :]
    if partition == "alternating":  # closed form: A = 1, 3, 5, ...; B = 0, 2, 4, ...
        a_idx, b_idx = (2 * ja + 1).expand(S, -1), (2 * jb).expand(S, -1)
        a_ok, b_ok = a_idx < n, b_idx < n
    elif partition == "contiguous":  # A = 0 .. n//2 - 1; B = n//2 .. n - 1
        half = n // 2
        a_idx, b_idx = ja.expand(S, -1), half + jb
        a_ok, b_ok = a_idx < half, b_idx < n
    else:
        is_a = split_ab(mask, partition, generator)
        a_idx, a_ok = compact(is_a, L // 2)
        b_idx, b_ok = compact(mask & ~is_a, (L + 1) // 2)
    return a_idx.masked_fill(~a_ok, 0), a_ok, b_idx.masked_fill(~b_ok, 0), b_ok


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
