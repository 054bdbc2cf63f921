"""A pipeline: protection -> chunker -> clusterer -> merger, under a budget, for one layer.

The pipeline is functional: ``compress`` returns a new state and never writes into the state it
was given, so an error (bad input, a budget that cannot be met) leaves the caller's cache as it was.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from .budget import LAYER_SCALE, target_slots as budget_slots
from .config import PipelineConfig, as_config
from .protocols import (ClusterPlan, CrossLayerGuard, FitsComposedPlan, FloorAware, HoleTolerant, LayerBudgetGuard,
                        LayeredGuard,
                        MergesInPlace, Needs, PersistentGuard, budget_scope_of, needs_of)
from .registry import CHUNKERS, CLUSTERERS, GUARDS, MERGERS
from .types import CompressionReport, KVState
from .validation import check_int, require


GUARD_MARK = "guarded"  # stats key: [B, H, N] uint8, slots a persistent guard protected once


class BudgetError(ValueError):
    """The budget cannot be met under the pipeline's protection and chunking."""


class BudgetWarning(UserWarning):
    """A budget was out of reach (``on_infeasible="warn"``): the cache is the smallest reached."""


# Shortfalls collected by an active ``budget_warnings()`` scope (None: warn from the pipeline).
_SCOPE: ContextVar[list | None] = ContextVar("kvcompress_budget_scope", default=None)


@dataclass(frozen=True)
class Shortfall:
    """One compression that missed its budget (met=False) or met it only through the fallback
    chunker (met=True). keep: slots / tokens of its worst head; why: what held it up."""

    pipeline: str
    budget: str
    layer_idx: int | None
    keep: float
    met: bool
    why: str


@contextmanager
def budget_warnings():
    """Gather the shortfalls of every compression inside (``on_infeasible="warn"``) into ONE
    BudgetWarning, issued when the block ends; ``kvcompress.generate`` wraps a call in it::

        with budget_warnings() as notes:   # notes: a list of Shortfall
            ...
    """
    notes: list[Shortfall] = []
    token = _SCOPE.set(notes)
    try:
        yield notes
    finally:
        _SCOPE.reset(token)
    if notes:
        warnings.warn(summarize_shortfalls(notes), BudgetWarning, stacklevel=3)


def summarize_shortfalls(notes: list[Shortfall]) -> str:
    """One message for a list of shortfalls: the worst one, and how many there were."""
    missed = [n for n in notes if not n.met]
    worst = max(missed or notes, key=lambda n: n.keep)
    count = len(missed or notes)
    where = "" if worst.layer_idx is None else f" (worst at layer {worst.layer_idx}" + (
        f"; {count} layer compressions alike)" if count > 1 else ")")
    if missed:
        return (f"pipeline {worst.pipeline!r}: {worst.budget} is out of reach: keep reached "
                f"{worst.keep:.3f}{where}: {worst.why}")
    return f"pipeline {worst.pipeline!r}: {worst.budget} met, keep reached {worst.keep:.3f}{where}, {worst.why}"


def _worst_keep(report: CompressionReport) -> float:
    """Slots / tokens of the worst head among the rows that missed their target (all rows when
    none did): rows left whole because they are short would otherwise read as keep 1.0."""
    ratio = report.slots_per_head.double() / report.tokens_per_row.clamp(min=1)[:, None].double()
    missed = (report.slots_per_head > report.target).any(-1)  # [B]
    rows = ratio[missed] if bool(missed.any()) else ratio
    return float(rows.max())


def chunk_floor(valid: Tensor, chunk_ids: Tensor) -> Tensor:
    """[B, H] long: the fewest slots one compression can reach with these chunks: every valid slot
    outside a chunk (protected, anchors) plus one slot per chunk.

    valid, chunk_ids: [B, H, N] (chunk ids non-decreasing along N among ids >= 0)
    """
    ids = torch.where(valid, chunk_ids, -1)
    fixed = (valid & (ids < 0)).sum(-1)
    seen = torch.cat([torch.full_like(ids[..., :1], -1), ids[..., :-1].cummax(-1).values], dim=-1)
    return fixed + ((ids >= 0) & (ids > seen)).sum(-1)


def _carried(own: Tensor, before: KVState, after: KVState) -> Tensor:
    """[B, H, M] bool: the slots of ``after`` that were protected by ``own`` in ``before``.
    Protected slots are never merged, so each keeps its position (unique within its head).

    own: [B, H, N] bool over ``before``'s slots
    """
    B, H, _ = own.shape
    T = before.num_tokens  # index T: where padding slots point
    tokens = torch.zeros(B, H, T + 1, dtype=torch.bool, device=own.device)
    tokens.scatter_(-1, torch.where(before.valid, before.positions, T), own & before.valid)
    return after.protected & after.valid & tokens.gather(-1, torch.where(after.valid, after.positions, T))


def join_chunks(valid: Tensor, chunk_ids: Tensor, groups: Tensor) -> Tensor:
    """Chunk ids with runs of consecutive chunks joined, so that a head has at most ``groups``
    chunks: chunk k of K (in order) joins group ``k * G // K``, i.e. every group holds
    floor(K / G) or ceil(K / G) consecutive chunks. Heads with K <= G are returned as they are.

    valid, chunk_ids: [B, H, N] (chunk ids non-decreasing along N among ids >= 0)
    groups:           [B, H] long, >= 1
    """
    ids = torch.where(valid, chunk_ids, -1)
    seen = torch.cat([torch.full_like(ids[..., :1], -1), ids[..., :-1].cummax(-1).values], dim=-1)
    opens = (ids >= 0) & (ids > seen)
    count = opens.sum(-1, keepdim=True)  # [B, H, 1] chunks per head
    rank = opens.long().cumsum(-1) - 1  # [B, H, N] ordinal of each slot's chunk
    g = groups.clamp(min=1)[..., None].to(ids.device)
    joined = torch.div(rank * g, count.clamp(min=1), rounding_mode="floor")
    return torch.where((ids >= 0) & (count > g), joined, chunk_ids)


def guard_mask(guard, state: KVState, layer_idx: int | None) -> Tensor:
    """[B, H, N] bool: the guard's slots in this layer (a ``LayeredGuard`` is told which layer)."""
    return guard.for_layer(state, layer_idx) if isinstance(guard, LayeredGuard) else guard(state)


def compose_plans(outer: Tensor, parent: Tensor) -> Tensor:
    """One plan over the input slots for two rounds of merging.

    outer:  [B, H, N] long, the first round's plan over the input slots (as a Merger takes it:
            parent[n] == n keeps n as a representative; the merged state's slot j is the j-th
            representative of its head, in slot order; -1 drops n)
    parent: [B, H, M] long, the second round's plan over the merged state's slots
    returns [B, H, N] long: each input slot merged straight into the input slot that represents
            its final cluster (-1 when either round dropped it). Representatives stay in slot
            order, so applying it gives the second round's slots in their order.
    """
    B, H, N = outer.shape
    M = parent.shape[-1]
    slot = torch.arange(N, device=outer.device)
    is_rep = outer == slot
    mid_of_rep = is_rep.long().cumsum(-1) - 1  # merged-state slot of each representative
    # input slot behind every merged-state slot (index M: a dump for the non-representatives)
    rep_input = torch.full((B, H, M + 1), -1, dtype=torch.long, device=outer.device)
    rep_input.scatter_(-1, torch.where(is_rep, mid_of_rep, M), slot.expand(B, H, N).contiguous())
    mid = torch.where(outer >= 0, mid_of_rep.gather(-1, outer.clamp(min=0)), -1)  # [B, H, N]
    final = torch.where(mid >= 0, parent.gather(-1, mid.clamp(min=0)), -1)
    return torch.where(final >= 0, rep_input.gather(-1, final.clamp(min=0)), -1)


# the chunking levels, mildest first; Chunking.level names the deepest one any head needed
LEVELS = ("chunker", "fallback", "joined", "window")


@dataclass(frozen=True)
class Chunking:
    """What one compression round may cluster: protected slots and chunk ids, both [B, H, N].

    level: "chunker" (the pipeline's chunker, as the method defines it), "fallback" (some head
    used ``fallback_chunker``), "joined" (runs of its chunks joined to fit the budget), "window"
    (sinks and recent window shrunk to half the budget). The last three need ``fallback_chunker``.
    """

    protected: Tensor
    chunk_ids: Tensor
    level: str = "chunker"


class Pipeline:
    """Compress one layer's KVState with the strategies named in a PipelineConfig.

        pipe = Pipeline("semanticache", keep_ratio=0.25)
        new_state, report = pipe.compress(state, layer_idx=3)
    """

    def __init__(self, config: PipelineConfig | Mapping | str = "semanticache", **overrides):
        self.config = as_config(config, **overrides)
        cfg = self.config
        self.chunker = CHUNKERS.create(cfg.chunker.name, cfg.chunker.params)
        self.fallback_chunker = (None if cfg.fallback_chunker is None else
                                 CHUNKERS.create(cfg.fallback_chunker.name, cfg.fallback_chunker.params))
        self._warned = False  # on_infeasible="warn" outside a budget_warnings() scope: once per pipeline
        self.clusterer = CLUSTERERS.create(cfg.clusterer.name, cfg.clusterer.params)
        self.merger = MERGERS.create(cfg.merger.name, cfg.merger.params)
        self.guards = tuple(GUARDS.create(g.name, g.params) for g in cfg.guards)
        self._cross = tuple(g for g in self.guards if isinstance(g, CrossLayerGuard))
        self._persistent = tuple(g for g in self.guards if isinstance(g, PersistentGuard) and g.persistent)
        self._layer_budgets = tuple(g for g in self._cross if isinstance(g, LayerBudgetGuard))
        strategies = (self.chunker, self.clusterer, self.merger, *self.guards)
        # rounds after the first merge in place (merged slots left as padding, one compaction at
        # the end) when everything that looks at a round's state sees slots only through ``valid``
        called = (self.chunker, self.clusterer, *([] if self.fallback_chunker is None else [self.fallback_chunker]),
                  *(g for g in self.guards if g not in self._persistent))  # persistent guards: marks
        self._rounds_in_place = isinstance(self.merger, MergesInPlace) and all(
            isinstance(s, HoleTolerant) and s.holes_ok for s in called)
        self.needs: Needs = Needs(query_window=cfg.query_window, attention=cfg.track_attention,
                                  all_layers=bool(self._cross)) | Needs.union(needs_of(s) for s in strategies)
        """What the cache must record or do for this pipeline (the config's query_window and
        track_attention, cross-layer guards, and every strategy's declared ``needs``)."""

    def __repr__(self) -> str:
        return f"Pipeline({self.config.name!r}, {self.config.to_dict()})"

    # ------------------------------------------------------------------ cross-layer guards
    @property
    def needs_all_layers(self) -> bool:
        """True when a guard decides from every layer at once: call ``prepare`` with all layers'
        states before compressing any of them (``CompressedCache`` does so after the prefill)."""
        return self.needs.all_layers

    def prepare(self, states) -> None:
        """Let cross-layer guards decide from ``states`` (one uncompressed KVState per layer, same
        tokens). Without this call, ``compress`` prepares them from the one layer it is given."""
        states = list(states)
        require(len(states) > 0 and all(isinstance(s, KVState) for s in states), "states",
                type(states).__name__, "a non-empty list of KVState, one per layer")
        first = states[0]
        for s in states[1:]:
            require(s.batch_size == first.batch_size and s.num_tokens == first.num_tokens, "states",
                    f"layers of {first.batch_size}x{first.num_tokens} and {s.batch_size}x{s.num_tokens} tokens",
                    "one state per layer of the same sequence (same batch size and tokens seen)")
        self._prepare(states)

    def _prepare(self, states: list, target_floor: Tensor | None = None) -> None:
        if not self._cross:
            return
        first = states[0]
        budget = self._targets(first, None, target_floor, scaled=False).amin(-1)  # [B]: an even split's
        T = first.num_tokens
        pos = torch.arange(T, device=first.keys.device)[None, :]  # [1, T]
        rel = pos - first.start()[:, None]
        already = (rel < self.config.sinks) | (pos >= T - self.config.recent) | (rel < 0)  # [B, T]
        for guard in self._cross:
            guard.prepare(states, budget, already)

    def _prepared(self, state: KVState, target_floor: Tensor | None = None, layer_idx: int | None = None) -> KVState:
        """Prepare cross-layer guards from this layer when nobody did, mark the slots of
        persistent guards in ``stats[GUARD_MARK]`` so later compressions keep them, and carry the
        layer's share of the budget (``extras[LAYER_SCALE]``) from its first compression on."""
        if GUARD_MARK not in state.stats:
            if any(not g.prepared_for(state) for g in self._cross):
                self._prepare([state], target_floor)
        if self._layer_budgets and LAYER_SCALE not in state.extras:
            scales = [s for g in self._layer_budgets
                      if g.prepared_for(state) and (s := g.layer_scale(state)) is not None]
            require(len(scales) <= 1, "guards", [type(g).__name__ for g in self._layer_budgets],
                    "at most one guard that splits the budget over the layers (the others at scale 1)")
            if scales:
                (scale,) = scales
                require(isinstance(scale, Tensor) and tuple(scale.shape) == (state.batch_size,)
                        and bool((scale > 0).all()), "layer_scale", tuple(getattr(scale, "shape", ())),
                        f"a [B] = ({state.batch_size},) tensor of positive factors")
                state = state.replace(extras={**state.extras, LAYER_SCALE: scale.to(torch.float64)})
        if not self._persistent:
            return state
        mark = torch.zeros_like(state.valid)
        for guard in self._persistent:
            mark |= guard_mask(guard, state, layer_idx)
        old = state.stats.get(GUARD_MARK)
        if old is not None:
            mark |= old > 0
        return state.replace(stats={**state.stats, GUARD_MARK: mark.to(torch.uint8)})

    # ------------------------------------------------------------------ budget & protection
    def target_slots(self, state: KVState, layer_idx: int | None = None) -> Tensor:
        """[B, H] long: slots each head may keep (the layer's share of the budget when its state
        carries one in ``extras[LAYER_SCALE]``)."""
        cfg = self.config
        B, H = state.batch_size, state.num_heads
        scale = state.extras.get(LAYER_SCALE)
        per_row = budget_slots(state.real_tokens(), cfg.keep_ratio, cfg.max_slots, scale)  # [B]
        target = per_row[:, None].expand(B, H).clone()
        for head in self.full_heads(layer_idx, H):
            target[:, head] = state.valid[:, head].sum(-1)
        return target.to(state.keys.device)

    def _targets(self, state: KVState, layer_idx: int | None, target_floor: Tensor | None,
                 scaled: bool = True) -> Tensor:
        """[B, H] long: ``target_slots``, raised to ``target_floor`` where one is given; without
        ``scaled``, an even split's (the layer's share left out)."""
        if not scaled and LAYER_SCALE in state.extras:
            state = state.replace(extras={k: v for k, v in state.extras.items() if k != LAYER_SCALE})
        target = self.target_slots(state, layer_idx)
        return target if target_floor is None else torch.maximum(target, target_floor.to(target.device))

    def full_heads(self, layer_idx: int | None, num_heads: int) -> list[int]:
        if layer_idx is None:
            return []
        heads = [h for (layer, h) in self.config.full_heads if layer == layer_idx]
        for h in heads:
            require(h < num_heads, "full_heads", (layer_idx, h), f"kv-head indices < {num_heads}")
        return heads

    def protection(self, state: KVState, layer_idx: int | None = None, *, sinks: Tensor | None = None,
                   recent: Tensor | None = None) -> Tensor:
        """[B, H, N] bool: sinks, recent window, guards, user-protected slots and full heads.

        sinks, recent: optional [B, H] long, per head, instead of the config's (the "window" level
        of ``chunking``)."""
        cfg = self.config
        valid = state.valid
        rel = state.positions - state.start()[:, None, None]  # [B, H, N] position in the row
        if sinks is None:
            protected = valid & (rel < cfg.sinks)
        else:
            protected = valid & (rel < sinks[..., None])
        if recent is None:
            if cfg.recent:
                protected |= valid & (state.positions >= state.num_tokens - cfg.recent)
        else:
            protected |= valid & (state.positions >= state.num_tokens - recent[..., None])
        if state.protected is not None:
            protected |= state.protected & valid
        marked = state.stats.get(GUARD_MARK)
        if marked is not None:
            protected |= (marked > 0) & valid
        for guard in self.guards:
            if marked is not None and guard in self._persistent:
                continue  # its slots are in the marks already
            mask = guard_mask(guard, state, layer_idx)
            require(tuple(mask.shape) == tuple(valid.shape) and mask.dtype == torch.bool,
                    "guard output", (tuple(mask.shape), mask.dtype), f"a bool mask of shape {tuple(valid.shape)}")
            protected |= mask & valid
        for head in self.full_heads(layer_idx, state.num_heads):
            protected[:, head] = valid[:, head]
        return protected

    def chunking(self, state: KVState, layer_idx: int | None = None, target: Tensor | None = None) -> Chunking:
        """Protection and chunk ids for one round towards ``target`` ([B, H] long; default: the budget).

        The pipeline's chunker, as the method defines it, wherever its floor (protected slots,
        anchors, one slot per chunk) fits the target. With a ``fallback_chunker``, a head whose
        budget lies below that floor goes down the levels until it fits, each only as far as needed:
        1. "fallback": the fallback chunker's chunks (SemantiCache: delimiters merged into their
           clause instead of kept as anchors);
        2. "window": when the sinks and the recent window alone leave no room for the rest (a
           short prompt at a low budget), they shrink to half of the budget, the recent window first;
        3. "joined": runs of consecutive chunks joined (``join_chunks``) until one slot per chunk fits.
        With no guards or user-protected slots in the way, every budget is then reachable.
        """
        if target is None:
            target = self._row_targets(state, self.target_slots(state, layer_idx))
        target = target.to(state.valid.device)
        protected = self.protection(state, layer_idx)
        chunk_ids = self.chunker(state, protected)
        if self.fallback_chunker is None:
            return Chunking(protected, chunk_ids)
        valid = state.valid
        over = chunk_floor(valid, chunk_ids) > target  # [B, H]
        if not bool(over.any()):
            return Chunking(protected, chunk_ids)
        level = 1
        chunk_ids = torch.where(over[..., None], self.fallback_chunker(state, protected), chunk_ids)

        cfg = self.config
        rel = state.positions - state.start()[:, None, None]
        window = valid & ((rel < cfg.sinks) | (state.positions >= state.num_tokens - cfg.recent))
        has_rest = (valid & ~window).any(-1)
        # only where sinks + recent window alone leave no room (guards in the way are not overruled)
        cramped = over & (window.sum(-1) + has_rest.long() > target)
        if bool(cramped.any()):
            level = 3
            cap = torch.div(target, 2, rounding_mode="floor")  # half the budget for sinks + recent
            sinks = cap.clamp(max=cfg.sinks)
            recent = (cap - sinks).clamp(max=cfg.recent)
            narrow = self.protection(state, layer_idx, sinks=sinks, recent=recent)
            protected = torch.where(cramped[..., None], narrow, protected)
            chunk_ids = torch.where(over[..., None], self.fallback_chunker(state, protected), chunk_ids)

        if bool((over & (chunk_floor(valid, chunk_ids) > target)).any()):
            level = max(level, 2)
            fixed = (valid & (chunk_ids < 0)).sum(-1)  # [B, H] protected (and the fallback's anchors)
            joined = join_chunks(valid, chunk_ids, (target - fixed).clamp(min=1))
            chunk_ids = torch.where(over[..., None], joined, chunk_ids)
        return Chunking(protected, chunk_ids, LEVELS[level])

    def floor(self, state: KVState, layer_idx: int | None = None) -> Tensor:
        """[B, H] long: the smallest cache one compression of ``state`` surely reaches: the
        clusterer's ``min_slots(valid, chunk_ids)`` when it has one, else the chunk floor of
        ``chunking`` (fallback levels included)."""
        chunks = self.chunking(state, layer_idx)
        if isinstance(self.clusterer, FloorAware):
            return self.clusterer.min_slots(state.valid, chunks.chunk_ids)
        return chunk_floor(state.valid, chunks.chunk_ids)

    # ------------------------------------------------------------------ compression
    def compress(self, state: KVState, layer_idx: int | None = None, *, target_floor: Tensor | None = None,
                 protect: Tensor | None = None) -> tuple[KVState, CompressionReport]:
        """Compress ``state`` to the budget; the input state is never modified.

        target_floor: [B, H] long or None; each head may keep at least this many slots (the
                      target is max(budget, floor); decode-time compression passes its floor)
        protect:      [B, H, N] bool or None; slots of ``state`` this call never merges or drops,
                      on top of the pipeline's own protection. Only for this call: the result's
                      ``protected`` is the state's own (None when it had none)

        A budget out of reach gives the smallest cache reached (``report.budget_met = False``):
        with ``on_infeasible='warn'`` (the default) and one BudgetWarning per pipeline (or per
        ``budget_warnings()`` scope) naming the keep reached and why; ``'best_effort'`` says nothing;
        ``'error'`` raises BudgetError (a ValueError). Rows no longer than ``sinks + recent`` are
        all protected: they stay uncompressed and count as within budget.
        """
        require(isinstance(state, KVState), "state", type(state).__name__, "a KVState")
        state.validate()
        if layer_idx is not None:
            check_int("layer_idx", layer_idx, 0)
        cfg = self.config
        own = state.protected
        if target_floor is not None:
            require(tuple(target_floor.shape) == (state.batch_size, state.num_heads), "target_floor",
                    tuple(target_floor.shape), f"a [B, H] = {(state.batch_size, state.num_heads)} tensor of slots")
        if protect is not None:
            require(tuple(protect.shape) == tuple(state.valid.shape) and protect.dtype == torch.bool, "protect",
                    (tuple(protect.shape), protect.dtype), f"a bool mask of shape {tuple(state.valid.shape)}")
            # merging carries ``protected`` slot for slot, so the mask holds for every round
            state = state.replace(protected=protect if own is None else own | protect)
        current = state = self._prepared(state, target_floor, layer_idx)  # first: it may carry the layer's budget share
        target = self._row_targets(state, self._targets(state, layer_idx, target_floor))
        # a merger fitted once: the rounds merge with its plain merger, their plans composed
        fits_once = isinstance(self.merger, FitsComposedPlan)
        merger = self.merger.round_merger if fits_once else self.merger
        composed = None  # [B, H, N] long over state's slots, once a round has merged
        taus = None
        rounds = 0
        level = 0
        in_place = self._rounds_in_place and not fits_once
        owned = False  # current's tensors are this call's own (a merge gave fresh ones): later rounds write into them
        holes = False  # current has merged slots left as padding: compact once after the last round
        for round_idx in range(cfg.max_rounds):
            slots = current.valid.sum(-1)
            if round_idx > 0 and self._met(slots, target):
                break
            chunks = self.chunking(current, layer_idx, target)
            protected, chunk_ids = chunks.protected, chunks.chunk_ids
            level = max(level, LEVELS.index(chunks.level))
            try:
                plan: ClusterPlan = self.clusterer(current, chunk_ids, target, round_idx)
            except ValueError as exc:  # name the method the user asked for, not only its parts
                where = f"pipeline {cfg.name!r} (clusterer {cfg.clusterer.name!r})"
                if isinstance(exc, BudgetError) or str(exc).startswith(where):
                    raise
                raise ValueError(f"{where}: {exc}") from exc
            parent = self._checked_plan(current, plan.parent, protected, chunk_ids)
            if plan.tau is not None:
                taus = plan.tau
            merged = merger.merge_in_place(current, parent) if owned else merger(current, parent)
            if fits_once:
                composed = parent if composed is None else compose_plans(composed, parent)
            rounds += 1
            progressed = merged.num_slots < current.num_slots or bool(
                (merged.valid.sum(-1) < slots).any())
            holes = holes or (owned and progressed)
            owned = in_place and progressed
            current = merged
            if plan.done or not progressed:
                break

        if holes:
            current = merger.compact(current)
        if composed is not None:
            # a round that merged made current (fresh tensors, read by no one else): the fit writes into them
            current = self.merger.fit_plan(state, composed, current, owned=current is not state)
        if protect is not None:
            current = current.replace(protected=None if own is None else _carried(own, state, current))
        slots = current.valid.sum(-1)
        met = self._met(slots, target)
        report = CompressionReport(
            slots_per_head=slots, tokens_per_row=state.real_tokens(), target=target,
            num_slots=current.num_slots, rounds=rounds, budget_met=met, tau=taus, layer_idx=layer_idx,
        )
        if not met and cfg.on_infeasible == "error":
            raise BudgetError(self._infeasible_message(state, layer_idx, slots, target))
        if cfg.on_infeasible == "warn":
            self._note_shortfall(state, layer_idx, report, LEVELS[level])
        return current, report

    def _row_targets(self, state: KVState, target: Tensor) -> Tensor:
        """``target`` with rows that the sinks and the recent window cover whole raised to their
        slots: such a row (a short prompt, a short row of a batch) stays uncompressed."""
        cfg = self.config
        short = state.real_tokens() <= cfg.sinks + cfg.recent  # [B]
        if not bool(short.any()):
            return target
        return torch.where(short[:, None], torch.maximum(target, state.valid.sum(-1)), target)

    def _note_shortfall(self, state: KVState, layer_idx, report: CompressionReport, level: str) -> None:
        """Warn (once per pipeline, or once per ``budget_warnings()`` scope) when the budget was
        missed, or when it was met only below the chunker's floor (``level`` past "chunker")."""
        scope = _SCOPE.get()
        if report.budget_met and level == "chunker":
            return
        if scope is None and self._warned:
            return
        cfg = self.config
        if report.budget_met:
            how = {"fallback": "", "joined": ", runs of its chunks joined",
                   "window": ", runs of its chunks joined and the sinks and recent window shrunk to half the budget"}
            why = (f"but only with the fallback chunker {cfg.fallback_chunker.name!r} "
                   f"{dict(cfg.fallback_chunker.params)}{how[level]}: chunker {cfg.chunker.name!r}, as the "
                   f"method defines it, cannot make the cache that small")
        else:
            why = self._shortfall_reason(state, layer_idx, report.slots_per_head, report.target)
            why += ("; the cache kept is the smallest reached (on_infeasible='error' raises instead, "
                    "'best_effort' does not warn)")
        note = Shortfall(cfg.name, self._budget_text(), layer_idx, _worst_keep(report), report.budget_met, why)
        if scope is not None:
            scope.append(note)
        else:
            self._warned = True
            warnings.warn(summarize_shortfalls([note]), BudgetWarning, stacklevel=3)

    def _budget_text(self) -> str:
        cfg = self.config
        return f"keep_ratio={cfg.keep_ratio}" if cfg.keep_ratio is not None else f"max_slots={cfg.max_slots}"

    def _shortfall_reason(self, state, layer_idx, slots, target) -> str:
        """Why the worst head could not go lower: its protected slots, anchors and chunks."""
        cfg = self.config
        worst = int((slots - target).argmax())
        b, h = divmod(worst, state.num_heads)
        protected = self.protection(state, layer_idx)
        one = (slice(b, b + 1), slice(h, h + 1))
        valid, free = state.valid[one], state.valid[one] & ~protected[one]

        def parts(chunker) -> tuple[int, int]:
            ids = chunker(state, protected)[one]
            fixed = int((free & (ids < 0)).sum())
            return fixed, int(chunk_floor(valid, ids)) - fixed - int(protected[one].sum())

        anchors, chunks = parts(self.chunker)
        why = (f"head (row {b}, head {h}) may keep {int(target[b, h])} slots of {int(state.real_tokens()[b])} "
               f"tokens but kept {int(slots[b, h])}: {int(protected[b, h].sum())} protected (sinks={cfg.sinks}, "
               f"recent={cfg.recent}{', guards' if cfg.guards else ''}), {anchors} anchors and {chunks} chunk(s) "
               f"of chunker {cfg.chunker.name!r} (merging keeps at least one slot per chunk)")
        if self.fallback_chunker is not None:
            anchors, chunks = parts(self.fallback_chunker)
            why += (f"; with the fallback chunker {cfg.fallback_chunker.name!r} "
                    f"{dict(cfg.fallback_chunker.params)}: {anchors} anchors and {chunks} chunk(s)")
        return why

    def _met(self, slots: Tensor, target: Tensor) -> bool:
        """Every head within its target, or, for a clusterer whose per-head counts may differ
        (``budget_scope == "layer"``, Ada-KV), every layer row within the sum of its targets."""
        if budget_scope_of(self.clusterer) == "layer":
            return bool((slots.sum(-1) <= target.sum(-1)).all())
        return bool((slots <= target).all())

    def _checked_plan(self, state: KVState, parent: Tensor, protected: Tensor, chunk_ids: Tensor) -> Tensor:
        """Enforce the invariants every plan must keep, whoever wrote the clusterer."""
        B, H, N = state.log_sizes.shape
        require(tuple(parent.shape) == (B, H, N) and parent.dtype == torch.long,
                "clusterer plan", (tuple(parent.shape), parent.dtype), f"a long tensor of shape {(B, H, N)}")
        slot = torch.arange(N, device=parent.device)
        parent = torch.where(state.valid, parent, -1)  # padding slots are always dropped
        # masked any() rather than boolean indexing: no gathers of the selected entries per round
        moved = parent != slot
        if bool((protected & moved).any()):
            raise RuntimeError(f"clusterer {self.config.clusterer.name!r} merged or dropped a protected slot")
        merged = (parent >= 0) & moved
        into = parent.clamp(min=0)
        if bool((protected.gather(-1, into) & merged).any()):
            raise RuntimeError(f"clusterer {self.config.clusterer.name!r} merged a slot into a protected slot")
        if bool((merged & ((chunk_ids.gather(-1, into) != chunk_ids) | (chunk_ids < 0))).any()):
            raise RuntimeError(f"clusterer {self.config.clusterer.name!r} merged across chunks")
        return parent

    def _infeasible_message(self, state, layer_idx, slots, target) -> str:
        cfg = self.config
        return (
            f"{self._budget_text()} is infeasible for pipeline {cfg.name!r}"
            f"{'' if layer_idx is None else f' at layer {layer_idx}'}: "
            f"{self._shortfall_reason(state, layer_idx, slots, target)}. Raise the budget, protect fewer "
            f"tokens (sinks={cfg.sinks}, recent={cfg.recent}), use a coarser chunker, or set "
            f"on_infeasible='warn' (or 'best_effort') to accept the smallest reachable cache"
        )
