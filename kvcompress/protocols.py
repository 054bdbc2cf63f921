"""The interfaces every strategy implements. Tensors in, tensors out.

A *merge plan* is one long tensor ``parent: [B, H, N]``: for each slot, the index of the slot it
merges into (a slot whose parent is itself is a representative and survives), or -1 when the
slot is dropped (eviction). Clusterers compute the plan once; the merger applies the same plan to
keys, values, sizes and positions alike (ToMe's habit).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from .types import KVState


@runtime_checkable
class Chunker(Protocol):
    def __call__(self, state: KVState, protected: Tensor) -> Tensor:
        """Split the clusterable slots into contiguous chunks.

        state:     the layer (uses positions, token_ids, ... as it needs)
        protected: [B, H, N] bool, slots that must stay as they are
        returns    chunk_ids [B, H, N] long, non-decreasing along N among slots >= 0;
                   -1 for slots that are not clustered (protected, anchors, padding)
        """
        ...


@runtime_checkable
class Clusterer(Protocol):
    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int) -> "ClusterPlan":
        """Plan one round of merges that never crosses chunks.

        chunk_ids: [B, H, N] long (-1 = leave the slot alone)
        target:    [B, H] long, slots each head should end with
        returns    a ClusterPlan (parent [B, H, N] long, done flag, optional tau [B, H])
        """
        ...


@runtime_checkable
class Merger(Protocol):
    def __call__(self, state: KVState, parent: Tensor) -> KVState:
        """Apply a merge plan. parent: [B, H, N] long (self = keep, other = merge into, -1 = drop)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    def __call__(self, state: KVState) -> Tensor:
        """Importance of each slot, [B, H, N] float (higher = more important)."""
        ...


@runtime_checkable
class Guard(Protocol):
    def __call__(self, state: KVState) -> Tensor:
        """Slots that must never be merged or dropped, [B, H, N] bool."""
        ...


class ClusterPlan:
    """A clusterer's answer: the merge plan, whether more rounds may help, and any threshold."""

    __slots__ = ("parent", "done", "tau")

    def __init__(self, parent: Tensor, done: bool = True, tau: Tensor | None = None):
        self.parent = parent  # [B, H, N] long
        self.done = done  # True: the clusterer will not merge more in later rounds
        self.tau = tau  # [B, H] float or None
