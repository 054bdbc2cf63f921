"""Decode-time compression: when a layer exceeds its budget by g slots, compress it back.

The cache appends raw tokens while generating (``append_tokens``); after each append it asks
``DecodeCompressor.should_compress`` and, if so, swaps in ``compress``'s result. Between two
compressions a head holds at most budget + g slots.

Budget. The pipeline's keep-ratio of the tokens seen, or its fixed slot cap (max_slots). While
few tokens have been seen, keep_ratio * T can be smaller than what the method can ever reach
(sinks + recent window + anchors, plus one slot per chunk, or the clusterer's own ``min_slots``:
one centroid for CSM, whose rounds re-cut chunks); the budget is then raised to that floor instead
of failing in the middle of a generation, and the report's ``target`` shows the budget used. A
max_slots cap that can never hold the sinks plus the recent window is a ValueError up front.

Cost. Each method declares a scope (the clusterer's ``decode_scope`` hook, see
``kvcompress.protocols.DecodeScoped``; "all" without it):

- "tail" (SemantiCache's GSC): only slots not yet compressed are clustered. A per-row frontier in
  ``state.extras["decode_frontier"]`` ([B] long, a token index) marks what earlier compressions
  covered; slots before it are frozen by a guard. With a chunker that keeps its last run open
  (the ``open_tail_start`` hook, e.g. the delimiter chunker) the unit is the chunks *completed*
  since the last compression: the run after the last delimiter (it continues into the recent
  window) is frozen too and waits until a delimiter closes it. Attempts, cheapest
  first: completed chunks, then the whole tail, then the whole cache (only when the tail alone
  cannot meet the budget, e.g. a tail full of delimiter anchors at a low keep-ratio).
  The clustering work is bounded by the tail; the linear bookkeeping passes over the slot
  tensors (masks, merge scatter) remain, as for the append itself.
- "all" (CentroidKV's CSM): the method re-clusters every clusterable slot, so old centroids keep
  absorbing tokens; its chunked matching costs O(n c d) for n slots and chunk size c, and at
  decode time one round usually suffices (only g + 1 slots must go).
- unknown methods (eviction baselines, plugins) default to "all": their scores may change.

A state that was compressed at prefill by a plain ``Pipeline`` has no frontier; the first
decode-time compression then treats the whole cache as the tail (once). Use
``DecodeCompressor.compress`` for the prefill too to avoid that.

Floor memo. A layer that cannot reach its target (SemantiCache at a low keep-ratio) sits above
target + g, so ``should_compress`` needs the floor at every step: protection plus the chunker over
the whole cache. For chunkers that declare ``append_monotone`` (delimiter, fixed, global) with
sinks / recent window / full heads as the only protection, appending tokens never lowers the floor (the new slot is
protected or opens or joins the last chunk; the slot leaving the recent window is an anchor or
joins or opens the last chunk). So the floor computed for a state stays a lower bound for every
state that extends it by appends only, and a step whose slots stay within max(target, that floor)
+ g is answered without the pass. The memo (per layer) checks "extends by appends only" exactly:
same positions, valid mask, token ids, row starts and vocabulary on the old slots, raw tokens
after them. Decisions and results are identical to recomputing the floor every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .budget import LAYER_SCALE, smallest_share, target_slots
from .pipeline import GUARD_MARK, Pipeline
from .protocols import AppendMonotone, CrossLayerGuard, DecodeScoped, FloorAware, OpenTail
from .types import CompressionReport, KVState
from .validation import check_choice, require

FRONTIER_KEY = "decode_frontier"  # [B] long: tokens before it were covered by a compression
_NO_LIMIT = torch.iinfo(torch.long).max

SCOPES = ("tail", "all")


def outside_window(state: KVState, lo: Tensor, hi: Tensor) -> Tensor:
    """[B, H, N] bool: valid slots whose position lies outside [lo, hi) (lo, hi: [B] long), the
    slots a tail attempt freezes."""
    pos = state.positions
    return state.valid & ((pos < lo[:, None, None]) | (pos >= hi[:, None, None]))


# states remembered per layer: caches that share one DecodeCompressor (clones of a cache, one per
# attention backend) each find their own
_MEMO_PER_LAYER = 4


@dataclass(frozen=True)
class _FloorEntry:
    """The floor of one state and what it was computed from (clones, so later writes cannot alter it)."""

    num_tokens: int
    positions: Tensor  # [B, H, N]
    valid: Tensor  # [B, H, N] bool
    token_ids: Tensor | None  # [B, T]
    seq_start: Tensor | None  # [B]
    vocab: object
    floor: Tensor  # [B, H] long

    @classmethod
    def of(cls, state: KVState, valid: Tensor, floor: Tensor) -> "_FloorEntry":
        ids = state.token_ids
        return cls(state.num_tokens, state.positions.clone(), valid.clone(),
                   None if ids is None else ids[:, : state.num_tokens].clone(),
                   None if state.seq_start is None else state.seq_start.clone(), state.vocab, floor)

    def lower_bound(self, state: KVState, valid: Tensor) -> Tensor | None:
        """[B, H] long: a floor no higher than ``state``'s when ``state`` is this entry's state
        plus appended raw tokens, else None."""
        n = self.positions.shape[-1]
        added = state.num_tokens - self.num_tokens
        if (added < 0 or state.num_slots - n != added or state.vocab is not self.vocab
                or tuple(state.positions.shape[:2]) != tuple(self.positions.shape[:2])
                or (state.seq_start is None) != (self.seq_start is None)
                or (state.token_ids is None) != (self.token_ids is None)):
            return None
        pos = state.positions
        if not (torch.equal(pos[..., :n], self.positions) and torch.equal(valid[..., :n], self.valid)):
            return None
        if added:
            new = torch.arange(self.num_tokens, state.num_tokens, device=pos.device)  # [added]
            if not (torch.equal(pos[..., n:], new.expand_as(pos[..., n:])) and bool(valid[..., n:].all())):
                return None
        if self.seq_start is not None and not torch.equal(state.seq_start, self.seq_start):
            return None
        if self.token_ids is not None:
            ids = state.token_ids
            if ids.shape[1] < self.num_tokens or not torch.equal(ids[:, : self.num_tokens], self.token_ids):
                return None
        return self.floor


class DecodeCompressor:
    """Budget bookkeeping for generation with one pipeline.

    pipeline: the method (its config gives the budget, g = recompress_every, sinks, recent)
    scope:    "tail", "all" or None (ask the method; see the module docstring)
    """

    def __init__(self, pipeline: Pipeline, scope: str | None = None):
        require(isinstance(pipeline, Pipeline), "pipeline", type(pipeline).__name__, "a kvcompress.Pipeline")
        cfg = pipeline.config
        if cfg.max_slots is not None:
            require(cfg.max_slots > cfg.sinks + cfg.recent, "max_slots", cfg.max_slots,
                    f"more than sinks + recent = {cfg.sinks} + {cfg.recent} slots: generation would "
                    f"exceed the cap with every new token")
        if scope is None:
            scope = pipeline.clusterer.decode_scope if isinstance(pipeline.clusterer, DecodeScoped) else "all"
        check_choice("scope", scope, SCOPES)
        self.pipeline = pipeline
        self.scope = scope
        # layer_idx -> [_FloorEntry], most recent first; None where appends might lower the floor
        # (guards, overridden protection, clusterers with their own min_slots, other chunkers)
        chunker = pipeline.chunker
        # (a fallback chunker's floor follows the target, which appends raise: no memo)
        memo_ok = (isinstance(chunker, AppendMonotone) and chunker.append_monotone and not pipeline.guards
                   and pipeline.fallback_chunker is None and not isinstance(pipeline.clusterer, FloorAware)
                   and type(pipeline).protection is Pipeline.protection
                   and type(self).floor is DecodeCompressor.floor)
        self._floors: dict | None = {} if memo_ok else None
        self._full = Pipeline(cfg)
        if scope == "tail":
            self._tail = Pipeline(cfg.replace(on_infeasible="best_effort"))

    def prepare_chunk(self, states, start: int) -> None:
        """Let the cross-layer guards decide for the tokens from ``start`` on (a prefill chunk)
        from every layer's state (one per layer, the same tokens). They choose among the new
        tokens only, within the chunk's share of the budget (target(T) - target(start)), so over
        all chunks they take what one decision over the whole prompt would; persistent guards'
        earlier choices stay marked."""
        states = list(states)
        first = states[0]
        cfg = self.pipeline.config
        T = first.num_tokens
        lead = first.start()  # [B] first real token of each row
        budget = (target_slots(first.real_tokens(), cfg.keep_ratio, cfg.max_slots)
                  - target_slots((start - lead).clamp(min=0), cfg.keep_ratio, cfg.max_slots)).clamp(min=0)
        pos = torch.arange(T, device=first.keys.device)[None, :]  # [1, T]
        rel = pos - lead[:, None]
        already = (pos < start) | (rel < cfg.sinks) | (pos >= T - cfg.recent) | (rel < 0)  # [B, T]
        pipelines = [self.pipeline, self._full] + ([self._tail] if self.scope == "tail" else [])
        for pipe in pipelines:
            for guard in pipe.guards:
                if isinstance(guard, CrossLayerGuard):
                    guard.prepare(states, budget, already)

    @property
    def g(self) -> int:
        return self.pipeline.config.recompress_every

    # ------------------------------------------------------------------ budget
    def floor(self, state: KVState, layer_idx: int | None = None, protect: Tensor | None = None) -> Tensor:
        """[B, H] long: the smallest cache one compression can surely reach (``Pipeline.floor``:
        the clusterer's ``min_slots`` when it has one, else the slots it never clusters plus one
        slot per chunk, with the pipeline's fallback levels). protect: [B, H, N] bool slots
        protected on top of the pipeline's protection, or None."""
        if protect is not None:
            extra = protect & state.valid
            state = state.replace(protected=extra if state.protected is None else state.protected | extra)
        return self.pipeline.floor(state, layer_idx)

    def budget(self, state: KVState, layer_idx: int | None = None, protect: Tensor | None = None) -> Tensor:
        """[B, H] long: the budget in generation, max(pipeline target, floor)."""
        target = self.pipeline.target_slots(state, layer_idx)
        floor = self.floor(state, layer_idx) if protect is None else self.floor(state, layer_idx, protect)
        return torch.maximum(target, floor)

    def should_compress(self, state: KVState, layer_idx: int | None = None, slack: int | None = None) -> bool:
        """True when some head holds more than budget + slack slots (slack: g by default; a
        prefill chunk passes 0: every chunk is compressed back to the budget)."""
        g = self.g if slack is None else slack
        cfg = self.pipeline.config
        # the smallest row's target; left padding only shrinks a row
        padding = 0 if state.seq_start is None else int(state.seq_start.max())
        lower = target_slots(state.num_tokens - padding, cfg.keep_ratio, cfg.max_slots)
        scale = state.extras.get(LAYER_SCALE)  # the layer's own share of the budget, if it has one
        lower = smallest_share(lower, None if scale is None else float(scale.min()))
        if state.num_slots <= lower + g:
            return False  # called every step: decide from Python ints when the tensor is small enough
        valid = state.valid
        slots = valid.sum(-1)  # [B, H]
        entries = self._memo_entries(state, layer_idx)
        known = None  # [B, H]: a floor remembered for a state this one extends by appends
        for i, entry in enumerate(entries or ()):
            known = entry.lower_bound(state, valid)
            if known is not None:
                entries.insert(0, entries.pop(i))
                break
        if known is not None and bool((slots <= known + g).all()):
            return False  # the floor can only have grown since, and the budget is >= the floor
        target = self.pipeline.target_slots(state, layer_idx)
        if not bool((slots > target + g).any()):
            return False  # cheap path: the floor can only raise the budget
        if known is not None and not bool((slots > torch.maximum(target, known) + g).any()):
            return False
        floor = self.floor(state, layer_idx)  # the whole-cache pass
        if entries is not None:
            del entries[: int(known is not None)]  # superseded by this state's floor
            entries.insert(0, _FloorEntry.of(state, valid, floor))
            del entries[_MEMO_PER_LAYER:]
        return bool((slots > torch.maximum(target, floor) + g).any())

    def _memo_entries(self, state: KVState, layer_idx: int | None) -> list | None:
        """This layer's remembered floors, or None when the state carries protection the memo
        cannot follow (user-protected slots, slots marked by persistent guards)."""
        if self._floors is None or state.protected is not None:
            return None
        if state.stats.get(GUARD_MARK) is not None:
            return None
        return self._floors.setdefault(layer_idx, [])

    # ------------------------------------------------------------------ compression
    def compress(self, state: KVState, layer_idx: int | None = None, *,
                 protect: Tensor | None = None) -> tuple[KVState, CompressionReport]:
        """Compress back to the budget. The state given is never modified; on BudgetError (only
        with on_infeasible='error' and a budget the whole cache cannot meet) nothing changes.

        protect: [B, H, N] bool slots this call never merges or drops (``Pipeline.compress``)
        """
        require(isinstance(state, KVState), "state", type(state).__name__, "a KVState")
        state.validate()
        if protect is not None:
            require(tuple(protect.shape) == tuple(state.valid.shape) and protect.dtype == torch.bool, "protect",
                    (tuple(protect.shape), protect.dtype), f"a bool mask of shape {tuple(state.valid.shape)}")
        budget = self.budget(state, layer_idx, protect)
        B = state.batch_size
        device = state.keys.device
        window_start = torch.full((B,), state.num_tokens - self.pipeline.config.recent,
                                  dtype=torch.long, device=device).clamp(min=0)
        frontier = state.extras.get(FRONTIER_KEY)
        frontier = torch.zeros(B, dtype=torch.long, device=device) if frontier is None else frontier.to(device)
        slots = state.valid.sum(-1)
        if bool((slots <= budget).all()):
            report = CompressionReport(
                slots_per_head=slots, tokens_per_row=state.real_tokens(), target=budget,
                num_slots=state.num_slots, rounds=0, budget_met=True, layer_idx=layer_idx)
            return state, report

        if self.scope == "tail":
            for lo, hi, new_frontier in self._tail_attempts(state, frontier, window_start):
                if not bool((hi > lo).any()):
                    continue
                frozen = outside_window(state, lo, hi)
                out, report = self._tail.compress(state, layer_idx, target_floor=budget,
                                                  protect=frozen if protect is None else frozen | protect)
                if report.budget_met:
                    return self._finish(out, torch.maximum(frontier, new_frontier)), report
        out, report = self._full.compress(state, layer_idx, target_floor=budget, protect=protect)
        return self._finish(out, torch.maximum(frontier, window_start)), report

    def _tail_attempts(self, state: KVState, frontier: Tensor, window_start: Tensor):
        """(lo, hi, new frontier) per attempt, each [B] long: clusterable positions [lo, hi)."""
        unlimited = torch.full_like(frontier, _NO_LIMIT)
        chunker = self.pipeline.chunker
        open_start = chunker.open_tail_start(state, frontier, window_start) if isinstance(chunker, OpenTail) else None
        if open_start is not None:
            # the run still open before the recent window waits until a boundary closes it
            yield frontier, open_start, open_start
        yield frontier, unlimited, window_start

    @staticmethod
    def _finish(state: KVState, frontier: Tensor) -> KVState:
        extras = {**state.extras, FRONTIER_KEY: frontier}
        return state.replace(extras=extras)


def append_tokens(state: KVState, keys: Tensor, values: Tensor, token_ids: Tensor | None = None) -> KVState:
    """Append q new raw tokens (size 1 each) after the state's slots.

    keys, values: [B, H, q, D]; token_ids: [B, q] or None
    """
    B, H, q, D = keys.shape
    require((B, H, D) == (state.batch_size, state.num_heads, state.head_dim), "keys", tuple(keys.shape),
            f"shape ({state.batch_size}, {state.num_heads}, q, {state.head_dim})")
    require(tuple(values.shape) == tuple(keys.shape), "values", tuple(values.shape), f"the keys' shape {tuple(keys.shape)}")
    T = state.num_tokens
    pos = torch.arange(T, T + q, device=keys.device).expand(B, H, q)
    new_ids = state.token_ids
    if state.token_ids is not None:
        add = token_ids if token_ids is not None else torch.full((B, q), -1, dtype=torch.long, device=keys.device)
        require(tuple(add.shape) == (B, q), "token_ids", tuple(add.shape), f"shape {(B, q)}")
        new_ids = torch.cat([state.token_ids[:, :T], add.to(state.token_ids)], dim=1)
    protected = state.protected
    if protected is not None:
        protected = torch.cat([protected, protected.new_zeros(B, H, q)], dim=-1)
    counts = state.counts
    if counts is not None:
        counts = torch.cat([counts, counts.new_ones(B, H, q)], dim=-1)
    # per-slot statistics of new slots start at 0; carried extras are left as they are
    stats = {name: torch.cat([x, x.new_zeros(B, H, q, *x.shape[3:])], dim=2) for name, x in state.stats.items()}
    return state.replace(
        counts=counts, stats=stats,
        keys=torch.cat([state.keys, keys.to(state.keys.dtype)], dim=2),
        values=torch.cat([state.values, values.to(state.values.dtype)], dim=2),
        log_sizes=torch.cat([state.log_sizes, state.log_sizes.new_zeros(B, H, q)], dim=-1),
        positions=torch.cat([state.positions, pos], dim=-1),
        num_tokens=T + q, token_ids=new_ids, protected=protected,
    )
