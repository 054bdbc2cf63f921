"""An example kvcompress plugin: the "windowed-average" clusterer and a preset that uses it.

kvcompress imports this module through the ``kvcompress.strategies`` entry point declared in
pyproject.toml; importing it registers the strategies below. Nothing else is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import kvcompress
from kvcompress import ClusterPlan, KVState, PipelineConfig, StrategySpec
from kvcompress.validation import check_int, require

__all__ = ["WindowedAverage", "runs_of", "slots_after"]


def runs_of(chunk_ids: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Runs of consecutive clusterable slots sharing a chunk id, per row (slots with chunk id -1
    are skipped: a run continues across them).

    chunk_ids: [R, N] long (-1 = not clusterable); valid: [R, N] bool
    returns    order [R, N] long  (clusterable slots first, in slot order: a compaction),
               rank  [R, N] long  (position of order[r, i] inside its run; -1 past the clusterable ones),
               run   [R, N] long  (run index of order[r, i] within its row; -1 past the clusterable ones)
    """
    R, N = chunk_ids.shape
    free = valid & (chunk_ids >= 0)
    idx = torch.arange(N, device=chunk_ids.device).expand(R, N)
    order = torch.where(free, idx, idx + N).argsort(dim=1)  # clusterable slots first, in order
    is_free = free.gather(1, order)  # [R, N]
    cid = chunk_ids.gather(1, order)
    prev = torch.cat([torch.full_like(cid[:, :1], -2), cid[:, :-1]], dim=1)
    # a run starts at the first clusterable slot and wherever the chunk id changes
    start = is_free & (cid != prev)
    start_at = torch.where(start, idx, 0).cummax(dim=1).values  # [R, N] compact index of the run start
    rank = torch.where(is_free, idx - start_at, -1)
    run = torch.where(is_free, start.long().cumsum(1) - 1, -1)
    return order, rank, run


def slots_after(run: Tensor, window: Tensor, outside: Tensor) -> Tensor:
    """Slots per row once every run is cut into windows: outside + sum over runs ceil(len / window).

    run: [R, N] from runs_of; window: [R] long >= 1; outside: [R] valid slots not in any run
    """
    R, N = run.shape
    lengths = torch.zeros(R, N + 1, dtype=torch.long, device=run.device)
    lengths.scatter_add_(1, run.clamp(min=-1) + 1, (run >= 0).long())  # column 0 collects non-members
    lengths = lengths[:, 1:]  # [R, N] length of run j of row r (0 for unused j)
    per_run = torch.div(lengths + window[:, None] - 1, window[:, None], rounding_mode="floor")
    return outside + per_run.sum(1)


@kvcompress.register_clusterer("windowed-average")
@dataclass(frozen=True)
class WindowedAverage:
    """Merge each run of ``window`` consecutive clusterable slots of a chunk into its first slot.

    window: slots per run (>= 1), or None to pick, per KV head, the smallest window whose result
            meets the head's target (bisection; the slot count only falls as the window grows)

    Position-only: it never looks at keys. A run never crosses a chunk; slots the chunker left out
    (protected slots, anchors: chunk id -1) are skipped, as chunkers skip them, and stay as they are.
    """

    window: int | None = None

    # optional hook for decode-time compression: re-cluster every clusterable slot (the windows
    # are cut afresh each time); "tail" would freeze what earlier compressions produced
    decode_scope = "all"

    def __post_init__(self):
        if self.window is not None:
            check_int("window", self.window, 1)

    def min_slots(self, valid: Tensor, chunk_ids: Tensor) -> Tensor:
        """Optional hook: [B, H] fewest slots one call can reach (one slot per run, or
        ceil(run / window) per run for a fixed window); decode-time budgets never go below it."""
        B, H, N = valid.shape
        _, _, run = runs_of(chunk_ids.reshape(B * H, N), valid.reshape(B * H, N))
        outside = valid.reshape(B * H, N).sum(1) - (run >= 0).sum(1)
        window = torch.full((B * H,), self.window or max(N, 1), dtype=torch.long, device=valid.device)
        return slots_after(run, window, outside).view(B, H)

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        B, H, N, _ = state.keys.shape
        R = B * H
        require(tuple(target.shape) == (B, H), "target", tuple(target.shape), f"shape {(B, H)}")
        valid = state.valid.reshape(R, N)
        cids = chunk_ids.reshape(R, N)
        order, rank, run = runs_of(cids, valid)
        outside = valid.sum(1) - (run >= 0).sum(1)  # [R]
        if self.window is not None:
            window = torch.full((R,), self.window, dtype=torch.long, device=cids.device)
        else:
            window = self._search(run, outside, target.reshape(R).to(cids.device))

        # member i of a run joins the first member of its window: compact index i - rank % window
        idx = torch.arange(N, device=cids.device).expand(R, N)
        head_of = torch.where(rank >= 0, idx - rank % window[:, None], idx)
        parent = torch.where(valid, torch.arange(N, device=cids.device), -1).reshape(R, N).clone()
        member = rank >= 0
        rows = torch.arange(R, device=cids.device)[:, None].expand(R, N)
        parent[rows[member], order[member]] = order.gather(1, head_of)[member]
        return ClusterPlan(parent.view(B, H, N), done=True)

    @staticmethod
    def _search(run: Tensor, outside: Tensor, target: Tensor) -> Tensor:
        """[R] smallest window per row whose slot count fits the target (the largest useful
        window when none does; the pipeline then reports the budget as not met)."""
        R, N = run.shape
        lo = torch.ones(R, dtype=torch.long, device=run.device)  # may not fit
        hi = torch.full((R,), max(N, 1), dtype=torch.long, device=run.device)  # fits if anything does
        while bool((lo < hi).any()):
            mid = torch.div(lo + hi, 2, rounding_mode="floor")
            fits = slots_after(run, mid, outside) <= target
            active = lo < hi
            hi = torch.where(active & fits, mid, hi)
            lo = torch.where(active & ~fits, mid + 1, lo)
        return hi


@kvcompress.register_preset("windowed-average")
def windowed_average() -> PipelineConfig:
    """SemantiCache's protection and delimiter chunks, with windows instead of similarity clusters."""
    return PipelineConfig(
        name="windowed-average", keep_ratio=0.5, sinks=4, recent=32,
        chunker=StrategySpec("delimiter"), clusterer=StrategySpec("windowed-average"),
        merger=StrategySpec("mean"),
    )
