"""A pipeline: protection -> chunker -> clusterer -> merger, under a budget, for one layer.

The pipeline is functional: ``compress`` returns a new state and never writes into the state it
was given, so an error (bad input, a budget that cannot be met) leaves the caller's cache as it was.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from .config import PipelineConfig, as_config
from .protocols import ClusterPlan
from .registry import CHUNKERS, CLUSTERERS, GUARDS, MERGERS
from .types import CompressionReport, KVState
from .validation import check_int, require


GUARD_MARK = "guarded"  # extras key: [B, H, N] uint8, slots a persistent guard protected once


class BudgetError(ValueError):
    """The budget cannot be met under the pipeline's protection and chunking."""


class Pipeline:
    """Compress one layer's KVState with the strategies named in a PipelineConfig.

        pipe = Pipeline("semanticache", keep_ratio=0.25)
        new_state, report = pipe.compress(state, layer_idx=3)
    """

    def __init__(self, config: PipelineConfig | Mapping | str = "semanticache", **overrides):
        self.config = as_config(config, **overrides)
        cfg = self.config
        self.chunker = CHUNKERS.create(cfg.chunker.name, cfg.chunker.params)
        self.clusterer = CLUSTERERS.create(cfg.clusterer.name, cfg.clusterer.params)
        self.merger = MERGERS.create(cfg.merger.name, cfg.merger.params)
        self.guards = tuple(GUARDS.create(g.name, g.params) for g in cfg.guards)
        self._cross = tuple(g for g in self.guards if getattr(g, "cross_layer", False))
        self._persistent = tuple(g for g in self.guards if getattr(g, "persistent", False))

    def __repr__(self) -> str:
        return f"Pipeline({self.config.name!r}, {self.config.to_dict()})"

    # ------------------------------------------------------------------ cross-layer guards
    @property
    def needs_all_layers(self) -> bool:
        """True when a guard decides from every layer at once: call ``prepare`` with all layers'
        states before compressing any of them (``CompressedCache`` does so after the prefill)."""
        return bool(self._cross)

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
        if not self._cross:
            return
        budget = self.target_slots(first).amin(-1)  # [B]
        T = first.num_tokens
        pos = torch.arange(T, device=first.keys.device)[None, :]  # [1, T]
        rel = pos - first.start()[:, None]
        already = (rel < self.config.sinks) | (pos >= T - self.config.recent) | (rel < 0)  # [B, T]
        for guard in self._cross:
            guard.prepare(states, budget, already)

    def _prepared(self, state: KVState) -> KVState:
        """Prepare cross-layer guards from this layer when nobody did, and mark the slots of
        persistent guards in ``extras[GUARD_MARK]`` so later compressions keep them."""
        if GUARD_MARK not in state.extras:
            if any(not g.prepared_for(state) for g in self._cross):
                self.prepare([state])
        if not self._persistent:
            return state
        mark = torch.zeros_like(state.valid)
        for guard in self._persistent:
            mark |= guard(state)
        old = state.extras.get(GUARD_MARK)
        if old is not None:
            mark |= old > 0
        return state.replace(extras={**state.extras, GUARD_MARK: mark.to(torch.uint8)})

    # ------------------------------------------------------------------ budget & protection
    def target_slots(self, state: KVState, layer_idx: int | None = None) -> Tensor:
        """[B, H] long: slots each head may keep."""
        cfg = self.config
        B, H = state.batch_size, state.num_heads
        if cfg.keep_ratio is not None:
            real = state.real_tokens().to(torch.float64)  # [B]
            per_row = torch.floor(real * cfg.keep_ratio + 1e-9).long().clamp(min=1)
            target = per_row[:, None].expand(B, H).clone()
        else:
            target = torch.full((B, H), cfg.max_slots, dtype=torch.long, device=state.keys.device)
        for head in self.full_heads(layer_idx, H):
            target[:, head] = state.valid[:, head].sum(-1)
        return target.to(state.keys.device)

    def full_heads(self, layer_idx: int | None, num_heads: int) -> list[int]:
        if layer_idx is None:
            return []
        heads = [h for (layer, h) in self.config.full_heads if layer == layer_idx]
        for h in heads:
            require(h < num_heads, "full_heads", (layer_idx, h), f"kv-head indices < {num_heads}")
        return heads

    def protection(self, state: KVState, layer_idx: int | None = None) -> Tensor:
        """[B, H, N] bool: sinks, recent window, guards, user-protected slots and full heads."""
        cfg = self.config
        valid = state.valid
        rel = state.positions - state.start()[:, None, None]  # [B, H, N] position in the row
        protected = valid & (rel < cfg.sinks)
        if cfg.recent:
            protected |= valid & (state.positions >= state.num_tokens - cfg.recent)
        if state.protected is not None:
            protected |= state.protected & valid
        marked = state.extras.get(GUARD_MARK)
        if marked is not None:
            protected |= (marked > 0) & valid
        for guard in self.guards:
            if marked is not None and guard in self._persistent:
                continue  # its slots are in the marks already
            mask = guard(state)
            require(tuple(mask.shape) == tuple(valid.shape) and mask.dtype == torch.bool,
                    "guard output", (tuple(mask.shape), mask.dtype), f"a bool mask of shape {tuple(valid.shape)}")
            protected |= mask & valid
        for head in self.full_heads(layer_idx, state.num_heads):
            protected[:, head] = valid[:, head]
        return protected

    # ------------------------------------------------------------------ compression
    def compress(self, state: KVState, layer_idx: int | None = None) -> tuple[KVState, CompressionReport]:
        """Compress ``state`` to the budget. Raises BudgetError (a ValueError) when the budget
        cannot be met and ``on_infeasible='error'``; the input state is never modified."""
        require(isinstance(state, KVState), "state", type(state).__name__, "a KVState")
        state.validate()
        if layer_idx is not None:
            check_int("layer_idx", layer_idx, 0)
        cfg = self.config
        target = self.target_slots(state, layer_idx)
        current = state = self._prepared(state)
        taus = None
        rounds = 0
        for round_idx in range(cfg.max_rounds):
            slots = current.valid.sum(-1)
            if round_idx > 0 and self._met(slots, target):
                break
            protected = self.protection(current, layer_idx)
            chunk_ids = self.chunker(current, protected)
            plan: ClusterPlan = self.clusterer(current, chunk_ids, target, round_idx)
            parent = self._checked_plan(current, plan.parent, protected, chunk_ids)
            if plan.tau is not None:
                taus = plan.tau
            merged = self.merger(current, parent)
            rounds += 1
            progressed = merged.num_slots < current.num_slots or bool(
                (merged.valid.sum(-1) < slots).any())
            current = merged
            if plan.done or not progressed:
                break

        slots = current.valid.sum(-1)
        met = self._met(slots, target)
        report = CompressionReport(
            slots_per_head=slots, tokens_per_row=state.real_tokens(), target=target,
            num_slots=current.num_slots, rounds=rounds, budget_met=met, tau=taus, layer_idx=layer_idx,
        )
        if not met and cfg.on_infeasible == "error":
            raise BudgetError(self._infeasible_message(state, layer_idx, slots, target))
        return current, report

    def _met(self, slots: Tensor, target: Tensor) -> bool:
        """Every head within its target, or, for a clusterer whose per-head counts may differ
        (``budget_scope == "layer"``, Ada-KV), every layer row within the sum of its targets."""
        if getattr(self.clusterer, "budget_scope", "head") == "layer":
            return bool((slots.sum(-1) <= target.sum(-1)).all())
        return bool((slots <= target).all())

    def _checked_plan(self, state: KVState, parent: Tensor, protected: Tensor, chunk_ids: Tensor) -> Tensor:
        """Enforce the invariants every plan must keep, whoever wrote the clusterer."""
        B, H, N = state.log_sizes.shape
        require(tuple(parent.shape) == (B, H, N) and parent.dtype == torch.long,
                "clusterer plan", (tuple(parent.shape), parent.dtype), f"a long tensor of shape {(B, H, N)}")
        slot = torch.arange(N, device=parent.device)
        parent = torch.where(state.valid, parent, -1)  # padding slots are always dropped
        if not bool((parent[protected] == slot.expand(B, H, N)[protected]).all()):
            raise RuntimeError(f"clusterer {self.config.clusterer.name!r} merged or dropped a protected slot")
        merged = (parent >= 0) & (parent != slot)
        into = parent.clamp(min=0)
        if bool((protected.gather(-1, into) & merged).any()):
            raise RuntimeError(f"clusterer {self.config.clusterer.name!r} merged a slot into a protected slot")
        if bool((chunk_ids.gather(-1, into) != chunk_ids)[merged].any()) or bool((chunk_ids[merged] < 0).any()):
            raise RuntimeError(f"clusterer {self.config.clusterer.name!r} merged across chunks")
        return parent

    def _infeasible_message(self, state, layer_idx, slots, target) -> str:
        cfg = self.config
        worst = int((slots - target).argmax())
        b, h = divmod(worst, state.num_heads)
        budget = f"keep_ratio={cfg.keep_ratio}" if cfg.keep_ratio is not None else f"max_slots={cfg.max_slots}"
        protected = int(self.protection(state, layer_idx)[b, h].sum())
        return (
            f"{budget} is infeasible for pipeline {cfg.name!r}"
            f"{'' if layer_idx is None else f' at layer {layer_idx}'}: head (batch {b}, head {h}) "
            f"may keep {int(target[b, h])} slots of {int(state.real_tokens()[b])} tokens but cannot go below "
            f"{int(slots[b, h])} (protected slots: {protected}, plus what the chunker "
            f"{cfg.chunker.name!r} keeps as anchors and one slot per chunk). Raise the budget, protect fewer "
            f"tokens (sinks={cfg.sinks}, recent={cfg.recent}), use a coarser chunker, or set "
            f"on_infeasible='best_effort' to accept the smallest reachable cache"
        )
