"""The ``fitted`` merger: merged slots whose bias and value reproduce the cluster's attention.

Any clusterer's plan works (GSC, CSM, the eviction-based ones). The plan is applied by the mean
merger first (positions, protection, sizes, per-slot statistics: all the bookkeeping, unchanged);
then every cluster of two or more members whose keys differ gets its attention bias and value
(and, with ``key="attention"``, its key) fitted against reference queries of the layer, see
``kvcompress.strategies.fitting``. Singletons and clusters of identical keys keep the mean
merger's numbers bit for bit (proportional attention is exact for them).

In a pipeline the fit runs once per compression (``FitsComposedPlan``): every round merges with
the proportional rule (so the clusterer sees what it sees under the mean merger, and the plan and
all bookkeeping are the mean merger's), the rounds' plans are composed into one plan over the input
slots, and each final slot is fitted against its ORIGINAL members, not against slots fitted in an
earlier round. A fitted slot with bias beta behaves in attention like exp(beta) copies of itself,
which is how a decode-time compression treats it: the fit only ever reads the bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..protocols import Needs
from ..registry import register_merger
from ..types import KVState
from ..validation import check_choice, check_int, check_range, require
from .fitting import fit_clusters, refine_jointly, row_part, split_moving
from .mergers import apply_merge_plan, is_identity_plan

NEG_INF = float("-inf")
REFERENCE_QUERIES = "reference_queries"  # extras: [B, Hq, R, D] strided prefill queries (rotated)
RECONSTRUCTION_QUERIES = "reconstruction_queries"  # extras: [B, Hq, R, D] from the reconstruction pass
WINDOW_QUERIES = "queries"  # extras: [B, Hq, W, D] the last W queries of the layer (query_window)
SOURCES = {"prefill": REFERENCE_QUERIES, "window": WINDOW_QUERIES, "reconstruction": RECONSTRUCTION_QUERIES}
ALIASES = {"both": "prefill+reconstruction"}
# the fit's rows take the staying slots' part from the joint steps' sums when the other slots (the
# fitted clusters' members, the dropped ones) are at most this share of the cache: the gather of
# those slots then costs less than the passes it saves (real 8k SmolLM2 layers, kvzip-copy-heads-banded:
# at 59 % of the cache the refit took 0.89x the time, at 82 % 1.06x; session 18)
SPLIT_SHARE = 0.7


def query_sources(queries: str) -> tuple[str, ...]:
    """The extras keys of a ``queries`` spec: a source, or sources joined by "+" ("window+reconstruction");
    "both" = "prefill+reconstruction". A ValueError naming ``queries`` otherwise."""
    parts = ALIASES.get(queries, queries).split("+") if isinstance(queries, str) else [queries]
    require(len(parts) == len(set(parts)) and all(p in SOURCES for p in parts), "queries", queries,
            f"one of {sorted(SOURCES)} or several joined by '+' (e.g. 'window+reconstruction'), or 'both'")
    return tuple(SOURCES[p] for p in parts)


_HOW = {
    REFERENCE_QUERIES: "give the merger reference_queries > 0 (its `needs` asks the cache to record "
                       "a strided sample of each layer's prefill queries)",
    WINDOW_QUERIES: "give the merger reference_queries > 0 (with queries='window' its `needs` asks the "
                    "cache for that many of each layer's last queries, query_window)",
    RECONSTRUCTION_QUERIES: "the reconstruction pass (issue 18) records them: a cache runs it at the "
                            "prefill's end for a pipeline whose needs ask for a model pass, as this "
                            "merger's do with queries='reconstruction' or 'both'",
}
KEY_MODES = ("mean", "attention")
ROUND_MODES = ("once", "each", "each+once")


def cluster_index(parent: Tensor) -> Tensor:
    """[B, H, N] long: the output slot of each slot under ``parent`` (as apply_merge_plan orders
    them: representatives in slot order), -1 for dropped slots."""
    slot = torch.arange(parent.shape[-1], device=parent.device)
    out_index = (parent == slot).long().cumsum(-1) - 1
    return torch.where(parent >= 0, out_index.gather(-1, parent.clamp(min=0)), -1)


def grouped_queries(state: KVState, names: tuple[str, ...], who: str = "fitted merger",
                    limit: int | None = None, stride: int = 1) -> Tensor:
    """The reference queries of ``names`` in extras, concatenated and grouped by KV head:
    [B, Hq, R, D] -> [B, H, G * R, D] (query head h * G + g belongs to KV head h)."""
    B, H, _, D = state.keys.shape
    parts = []
    for name in names:
        q = state.extras.get(name)
        require(q is not None, f"{who}: state.extras[{name!r}]", None,
                f"the reference queries [B, Hq, R, D] of the layer: {_HOW[name]}")
        require(isinstance(q, Tensor) and q.dim() == 4 and q.shape[0] == B and q.shape[3] == D
                and q.shape[1] % H == 0 and q.shape[2] >= 1, f"{who}: state.extras[{name!r}]",
                tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__,
                f"a tensor [B={B}, Hq (a multiple of {H}), R >= 1, D={D}]")
        if name == WINDOW_QUERIES and limit is not None:
            q = q[:, :, -limit:]  # other strategies may have asked for a longer window
        if stride > 1:  # every stride-th query, the last one included
            q = q[:, :, (q.shape[2] - 1) % stride::stride]
        parts.append(q.reshape(B, H, -1, D))
    return torch.cat(parts, dim=2).to(state.keys.device)


@register_merger("fitted")
@dataclass(frozen=True)
class FittedMerger:
    """Fit each merged slot's attention bias and value (optionally key) to its cluster.

    queries:           "window" (the last R queries of the layer, extras["queries"]: closest to
                       the queries that follow), "prefill" (R strided prefill queries,
                       extras["reference_queries"]), "reconstruction" (the reconstruction pass's,
                       extras["reconstruction_queries"]; the pass is a model pass the merger's
                       needs ask for), or several joined by "+"; "both" = "prefill+reconstruction"
    reference_queries: R, queries per layer the cache records for "window" / "prefill"
    key:               "mean" (the size-weighted mean key) or "attention" (weighted by the
                       attention the reference queries pay to each member)
    power:             a query's weight is the cluster's share of its attention row ** power
    ridge:             pseudo-queries of the proportional answer the fit shrinks toward
    scale:             logit scale; None = 1/sqrt(head_dim)
    rounds:            in a pipeline, "once" (fit the rounds' composed plan once, after the last
                       round, against the original members), "each" (fit after every round,
                       later rounds clustering the fitted slots: the slow reference, and what
                       the merger did before fitting once) or "each+once" (both: every round
                       fits, then the final slots are refitted against the original members,
                       shrinking toward the rounds' fitted slots)
    refine:            after the per-cluster fit, ``refine`` soft-sign gradient steps on the fitted
                       keys of the head's joint output error over the reference queries, then one
                       ridge least-squares solve of the fitted values against it (the slots
                       compensate each other); 0 = the per-cluster closed form only
    refine_step:       the key steps' size in logit units (a step moves no query's logit by more)
    refine_share:      the share of each head's fitted slots the key steps and the value solve move:
                       the ones the reference queries attend to most under the closed form (the
                       others keep it; their part of the rows is computed once); 1.0 = every fitted
                       slot (the steps' cost scales with it)
    query_stride:      the fit reads every ``query_stride``-th of each source's queries (the last one
                       included): the same span of the window for a share of the work
    """

    queries: str = "window"
    reference_queries: int = 32
    key: str = "attention"
    power: float = 1.0
    ridge: float = 1.0
    scale: float | None = None
    rounds: str = "once"
    refine: int = 3
    refine_step: float = 0.7
    refine_share: float = 1.0
    query_stride: int = 1

    def __post_init__(self):
        query_sources(self.queries)
        check_int("reference_queries", self.reference_queries, 1)
        check_choice("key", self.key, KEY_MODES)
        check_choice("rounds", self.rounds, ROUND_MODES)
        check_range("power", self.power, 0.0, 8.0)
        check_range("ridge", self.ridge, 0.0, 1e6)
        check_int("refine", self.refine, 0)
        require(self.refine <= 16, "refine", self.refine, "an integer in [0, 16] (key steps)")
        check_range("refine_step", self.refine_step, 0.0, 8.0)
        check_range("refine_share", self.refine_share, 0.0, 1.0, lo_open=True)
        check_int("query_stride", self.query_stride, 1)
        if self.scale is not None:
            check_range("scale", self.scale, 0.0, 1e3, lo_open=True)

    @property
    def needs(self) -> Needs:
        """The queries it fits to: strided prefill queries, the query window, or the model pass
        whose reconstruction queries it reads (the pass records them)."""
        uses = set(query_sources(self.queries))
        return Needs(query_window=self.reference_queries if WINDOW_QUERIES in uses else 0,
                     reference_queries=self.reference_queries if REFERENCE_QUERIES in uses else 0,
                     model_pass=RECONSTRUCTION_QUERIES in uses)

    @property
    def round_merger(self):
        """In a pipeline, every round merges with the proportional rule and the fit runs once, on
        the rounds' composed plan, against the original members (``FitsComposedPlan``); with
        rounds="each", every round fits (this merger itself)."""
        if self.rounds == "once":
            return ProportionalRounds()
        return self if self.rounds == "each" else replace(self, rounds="each")

    def __call__(self, state: KVState, parent: Tensor) -> KVState:
        """One plan: the proportional merge, then the fit (what ``fit_plan`` does after a
        pipeline's rounds)."""
        if is_identity_plan(state, parent):
            return state
        # the proportional merge of a plan that is not the identity is fresh tensors: this call's own
        return self.refit(state, parent, ProportionalRounds()(state, parent), owned=True)

    def fit_plan(self, state: KVState, parent: Tensor, merged: KVState, *, owned: bool = False) -> KVState:
        """After a pipeline's last round: ``refit`` (rounds="once"); with rounds="each" the
        rounds fitted already and ``merged`` is returned as it is. owned: as ``refit``'s (the
        pipeline's rounds merged at least once: ``merged`` is the rounds' fresh state)."""
        return merged if self.rounds == "each" else self.refit(state, parent, merged, owned=owned)

    def refit(self, state: KVState, parent: Tensor, merged: KVState, *, owned: bool = False) -> KVState:
        """Refit the merged slots of ``merged`` to their members in ``state``.

        state:  the slots before merging (keys/values [B, H, N, D], the reference queries in extras)
        parent: [B, H, N] long, the plan taking ``state`` to ``merged`` (several rounds composed)
        merged: the proportional merge of ``state`` under ``parent`` (M slots): its bookkeeping
                (positions, protection, counts, stats) is kept; only fitted slots' key, value and
                bias change
        owned:  ``merged``'s keys, values and log_sizes are the caller's to give up (a merge's fresh
                tensors, read by no one else, not views of ``state``'s): the fitted rows are written
                into them (contiguous ones) instead of into copies. Else ``merged`` is left untouched.
                The result is the same bit for bit; on CPU the copies were ~4-7 ms a layer at 8k
                (two fresh [B*H*M, D] tensors: their page faults and the copy)
        """
        if is_identity_plan(state, parent):
            return merged
        cluster = cluster_index(parent)
        B, H, M = merged.log_sizes.shape
        require(int(cluster.max()) < M if cluster.numel() else True, "merged", f"{M} slots",
                "the merge of state under parent (one slot per representative)")
        N, D = state.num_slots, state.head_dim
        rows = B * H
        dev = parent.device
        member = cluster >= 0
        counts = merged.token_counts()  # the rounds' token counts, whatever the bias becomes
        # a cluster whose members' keys are all bitwise equal to its representative's is exact under
        # proportional attention (and the mean merger returns that key): keep it bit for bit. A
        # cluster with a differing member has two members or more, so "differs" is the whole test.
        # (a cache's [B, N, H, D]-strided views copied once: every pass below reads them whole)
        k_in, v_in = state.keys.contiguous(), state.values.contiguous()
        differs = member & _differs_from(k_in, parent.clamp(min=0))
        fit = torch.zeros(rows * (M + 1), device=dev).index_add_(
            0, _flat_index(torch.where(member, cluster, M), M + 1), differs.reshape(-1).float()
        ).view(B, H, M + 1)[:, :, :M] > 0  # [B, H, M]
        if not bool(fit.any()):
            return merged.replace(counts=counts)
        queries = grouped_queries(state, query_sources(self.queries), limit=self.reference_queries,
                                  stride=self.query_stride)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(state.head_dim)
        # fit only the K clusters per head that need it, renumbered 0..K-1 (heads with fewer have
        # empty rows: no members, never read); index copies in and out, no [B, H, M, D] gathers
        fit_rows, at, K, rank = _compaction(fit)

        fit_gather = _gather_plan(fit_rows, at, rows * K)

        def compact(x: Tensor, shape: tuple) -> Tensor:
            return _compact(x, fit_gather).view(shape)

        sub = torch.where(fit, rank, -1)
        prior_k, prior_v = compact(merged.keys, (B, H, K, D)), compact(merged.values, (B, H, K, D))
        prior_b = compact(merged.log_sizes, (B, H, K))
        # members of clusters not fitted still count in the attention rows (cluster -1)
        sub_cluster = torch.where(member, sub.gather(-1, cluster.clamp(min=0)), -1)  # [B, H, N]
        def put(x: Tensor, fitted: Tensor, dtype: torch.dtype) -> Tensor:
            """The fitted rows into x (owned, contiguous) or into a copy of x."""
            out = x.view(rows * M, -1) if owned and x.is_contiguous() else x.reshape(rows * M, -1).to(dtype, copy=True)
            out.index_copy_(0, fit_rows, fitted.reshape(-1, out.shape[1]).index_select(0, at).to(dtype))
            return out.view(x.shape)

        # the slots that are not fitted stay put (singletons, identical members: exact in the merge):
        # their part of the rows is computed once, over the slots that stay (compacted, not all M), for
        # the joint steps and, when they stand for enough of the cache, for the fit's rows too: its
        # N-wide passes then read only the other slots, the fitted clusters' members and the dropped
        # ones (the rows count them), gathered once
        inner = (sub_cluster >= 0) | (~member & (state.log_sizes > NEG_INF))
        split = int(inner.sum(-1).max()) <= SPLIT_SHARE * N  # the most such slots in a head (the compaction's width)
        rest = None
        if self.refine or split:
            stay_rows, stay_at, S, _ = _compaction(~fit)
            S = max(S, 1)
            stay_plan = _gather_plan(stay_rows, stay_at, rows * S)

            def stay(x: Tensor, fill: float = 0.0) -> Tensor:
                return _compact(x, stay_plan, fill).view(B, H, S, *x.shape[3:])

            rest = row_part(stay(merged.keys), stay(merged.values), stay(merged.log_sizes.float(), NEG_INF),
                            queries, scale)
        fit_in = (k_in, v_in, state.log_sizes, sub_cluster)
        if split:
            in_rows, in_at, N_in, _ = _compaction(inner)
            in_plan = _gather_plan(in_rows, in_at, rows * N_in)
            fit_in = tuple(_compact(x, in_plan, fill).view(B, H, N_in, *x.shape[3:]) for x, fill in
                           zip((k_in, v_in, state.log_sizes.float(), sub_cluster), (0.0, 0.0, NEG_INF, -1)))
        res = fit_clusters(*fit_in, queries, prior_k, prior_v, prior_b, scale=scale, power=self.power,
                           ridge=self.ridge, key=self.key, rest=rest if split else None)
        keys, values = res.keys, res.values
        if self.refine:
            live = torch.zeros(rows * K, dtype=torch.bool, device=dev).index_fill_(0, at, True).view(B, H, K)
            bias = res.bias.masked_fill(~live, NEG_INF)
            if self.refine_share < 1.0:
                moving, rest = split_moving(keys, values, bias, rest, queries, scale=scale, share=self.refine_share,
                                            logits=res.logits)
                # whole rows of the flat views (index_select / index_copy_, not gather / scatter
                # through expanded indices); keys and values are the fit's own fresh tensors
                T = moving.shape[-1]
                take = _flat_index(moving, K)

                def rows_of(x: Tensor) -> Tensor:
                    return x.reshape(rows * K, -1).index_select(0, take).view(B, H, T, -1)

                moved_k, moved_v = refine_jointly(
                    rows_of(keys), rows_of(values), bias.reshape(-1).index_select(0, take).view(B, H, T), rest,
                    queries, res.targets, scale=scale, steps=self.refine, step=self.refine_step,
                    dtype=merged.keys.dtype, logits=rows_of(res.logits))
                keys.view(rows * K, D).index_copy_(0, take, moved_k.reshape(-1, D))
                values.view(rows * K, D).index_copy_(0, take, moved_v.reshape(-1, D))
            else:
                keys, values = refine_jointly(keys, values, bias, rest, queries, res.targets, scale=scale,
                                              steps=self.refine, step=self.refine_step, dtype=merged.keys.dtype,
                                              logits=res.logits)
        # only the fitted rows change: everything else stays the merge's, bit for bit
        return merged.replace(keys=put(merged.keys, keys, merged.keys.dtype),
                              values=put(merged.values, values, merged.values.dtype),
                              log_sizes=put(merged.log_sizes, res.bias, merged.log_sizes.dtype), counts=counts)


def _compaction(mask: Tensor) -> tuple[Tensor, Tensor, int, Tensor]:
    """The True slots of ``mask`` [B, H, M] renumbered 0..K-1 per head (K = the most in a head):
    their flat rows in [B * H * M], their flat rows in [B * H * K], K, and each slot's rank."""
    M = mask.shape[-1]
    rows = mask.reshape(-1).nonzero().squeeze(1)
    rank = mask.long().cumsum(-1) - 1
    K = int(rank[..., -1].max()) + 1 if mask.numel() else 0
    at = (rows // M) * K + rank.reshape(-1).index_select(0, rows)
    return rows, at, K, rank


def _gather_plan(rows: Tensor, at: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """``_compaction``'s renumbering as one gather: the source row in [B * H * M] of each of the
    ``size`` compact rows (row 0 for a padding row) and the padding rows (filled after the gather)."""
    src = torch.zeros(size, dtype=torch.long, device=rows.device).index_copy_(0, at, rows)
    pad = torch.ones(size, dtype=torch.bool, device=rows.device).index_fill_(0, at, False)
    return src, pad.nonzero().squeeze(1)


def _compact(x: Tensor, plan: tuple[Tensor, Tensor], fill: float = 0.0) -> Tensor:
    """The rows of x [B, H, M, ...] (flat) renumbered by ``plan`` (``_gather_plan``): one gather of
    whole rows (no filled tensor written first, no gathered temporary copied in), ``fill`` in the
    padding rows. Requires M >= 1."""
    flat = x.reshape(-1, x.shape[-1]) if x.dim() == 4 else x.reshape(-1)
    src, pad = plan
    out = flat.index_select(0, src)
    return out.index_fill_(0, pad, fill) if pad.numel() else out


def _flat_index(index: Tensor, width: int) -> Tensor:
    """[B, H, N] indices into rows of ``width`` -> [B * H * N] indices into the flat [B * H * width]."""
    B, H, N = index.shape
    return (torch.arange(B * H, device=index.device)[:, None] * width + index.reshape(B * H, N)).reshape(-1)


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_words(x: Tensor) -> Tensor:
    """[n, E] rows (contiguous) -> [n, W] integers of the widest width that divides a row's bytes:
    the same bits, compared in fewer steps."""
    row = x.shape[-1] * x.element_size()
    width = next(w for w in (8, 4, 2, 1) if row % w == 0)
    return x.view(torch.uint8).view(_INT_OF[width])


def _differs_from(keys: Tensor, other: Tensor) -> Tensor:
    """[B, H, N] bool: slot n's key is not bitwise equal to slot other[n]'s (other: [B, H, N] long).
    Exact: only the slots whose other slot is not themselves are compared, bit pattern by bit
    pattern (a representative's own members are the merged ones: a fraction of the slots), in
    8-byte words where a key's bytes allow."""
    B, H, N, D = keys.shape
    bits = _as_words(keys.reshape(B * H * N, D))
    index = _flat_index(other, N)
    pairs = (index != torch.arange(index.numel(), device=index.device)).nonzero().squeeze(1)
    differs = torch.zeros(B * H * N, dtype=torch.bool, device=keys.device)
    if pairs.numel():
        other_rows = index.index_select(0, pairs)
        # the first word settles most pairs (real keys of different tokens differ in their first
        # entries): only pairs equal there gather whole rows, instead of every pair's two rows
        first = bits[:, 0]
        unsettled = first.index_select(0, pairs) == first.index_select(0, other_rows)
        differs[pairs] = ~unsettled
        if bits.shape[1] > 1 and bool(unsettled.any()):
            tied = unsettled.nonzero().squeeze(1)
            pairs, other_rows = pairs.index_select(0, tied), other_rows.index_select(0, tied)
            unequal = bits.index_select(0, pairs) != bits.index_select(0, other_rows)
            differs[pairs] = _as_words(unequal).ne(0).any(-1)
    return differs.view(B, H, N)


@dataclass(frozen=True)
class ProportionalRounds:
    """The fitted merger's rounds: the mean merger's plan application (positions, protection,
    stats), weighing a slot by its attention bias (a slot of bias beta is exp(beta) copies for
    attention and for the fit's prior) while its token count is kept apart and adds up."""

    def __call__(self, state: KVState, parent: Tensor) -> KVState:
        if is_identity_plan(state, parent):
            return state
        merged = apply_merge_plan(state.replace(counts=None), parent)
        cluster = cluster_index(parent)
        B, H, M = merged.log_sizes.shape
        counts = state.token_counts().masked_fill(cluster < 0, 0.0)
        total = counts.new_zeros(B, H, M + 1).scatter_add_(-1, torch.where(cluster >= 0, cluster, M), counts)
        return merged.replace(counts=total[..., :M].contiguous())
