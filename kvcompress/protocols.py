"""The interfaces every strategy implements. Tensors in, tensors out.

A *merge plan* is one long tensor ``parent: [B, H, N]``: for each slot, the index of the slot it
merges into (a slot whose parent is itself is a representative and survives), or -1 when the
slot is dropped (eviction). Clusterers compute the plan once; the merger applies the same plan to
keys, values, sizes and positions alike (ToMe's habit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

from torch import Tensor

from .types import KVState
from .validation import check_int, require


@dataclass(frozen=True)
class Needs:
    """What a strategy needs the cache to record or do for it (the pipeline takes the union).

    query_window:      the last W prefill/decoding queries of each layer -> ``extras["queries"]``
                       [B, Hq, W, D] (rotated, unscaled)
    reference_queries: R queries strided evenly over the prefill, the last one included ->
                       ``extras["reference_queries"]`` [B, Hq, R, D] (rotated, unscaled)
    attention:         the attention each slot receives -> ``stats["attn_acc"]`` [B, H_kv, N]
    all_layers:        compression at the prefill's end waits until every layer is in
                       (cross-layer guards)
    model_pass:        the cache runs a model pass at the prefill's end before compressing
                       (e.g. a reconstruction scorer); implies ``all_layers``
    surprisal:         that pass also records each context token's surprisal (-log p of the token
                       as the pass predicts it) -> ``extras["surprisal"]`` [B, T]; implies ``model_pass``
    pass_lead:         L > 0: that pass gives every chunk after the first a lead-in of the L context
                       tokens before it (``reconstruction_scores(lead=L)``), so a chunk's first tokens
                       are scored mid-copy; implies ``model_pass``. Two strategies asking for different
                       lead-ins get the longer one
    pass_aligned:      that pass places every chunk where one full repeat of the context would
                       (``reconstruction_scores(aligned=True)``), so every chunk is copied from the
                       same distance; implies ``model_pass``. One strategy asking for it is enough
    """

    query_window: int = 0
    reference_queries: int = 0
    attention: bool = False
    all_layers: bool = False
    model_pass: bool = False
    surprisal: bool = False
    pass_lead: int = 0
    pass_aligned: bool = False

    def __post_init__(self):
        check_int("query_window", self.query_window, 0)
        check_int("reference_queries", self.reference_queries, 0)
        check_int("pass_lead", self.pass_lead, 0)
        for name in ("attention", "all_layers", "model_pass", "surprisal", "pass_aligned"):
            require(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        if (self.surprisal or self.pass_lead or self.pass_aligned) and not self.model_pass:
            object.__setattr__(self, "model_pass", True)
        if self.model_pass and not self.all_layers:
            object.__setattr__(self, "all_layers", True)

    def __or__(self, other: "Needs") -> "Needs":
        require(isinstance(other, Needs), "needs", type(other).__name__, "a Needs")
        return Needs(
            query_window=max(self.query_window, other.query_window),
            reference_queries=max(self.reference_queries, other.reference_queries),
            attention=self.attention or other.attention,
            all_layers=self.all_layers or other.all_layers,
            model_pass=self.model_pass or other.model_pass,
            surprisal=self.surprisal or other.surprisal,
            pass_lead=max(self.pass_lead, other.pass_lead),
            pass_aligned=self.pass_aligned or other.pass_aligned,
        )

    @classmethod
    def union(cls, items: Iterable["Needs"]) -> "Needs":
        out = cls()
        for item in items:
            out = out | item
        return out


# ---------------------------------------------------------------------------- optional hooks
# A strategy implements a hook by having the member; the pipeline and DecodeCompressor ask through
# these protocols (structural checks), never by probing names. Strategies that are plain
# functions implement none of them.
@runtime_checkable
class DeclaresNeeds(Protocol):
    """Any strategy: ``needs`` (an attribute or property) says what the cache must record."""

    needs: Needs


def needs_of(strategy) -> Needs:
    """The strategy's declared needs (nothing for a strategy without the hook)."""
    if isinstance(strategy, DeclaresNeeds):
        needs = strategy.needs
        require(isinstance(needs, Needs), f"{type(strategy).__name__}.needs", type(needs).__name__,
                "a kvcompress.protocols.Needs")
        return needs
    return Needs()


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


@runtime_checkable
class CrossLayerGuard(Protocol):
    """A guard that decides from every layer at once (``Pipeline.prepare`` hands it all layers'
    states before any is compressed); the pipeline's needs then include ``all_layers``."""

    def prepare(self, states: Sequence[KVState], budget: Tensor, already: Tensor) -> None:
        """states: one KVState per layer; budget: [B] slots per head; already: [B, T] bool
        tokens protected anyway (sinks, recent window)."""
        ...

    def prepared_for(self, state: KVState) -> bool:
        """True when ``prepare`` decided for this state's sequence."""
        ...


@runtime_checkable
class LayerBudgetGuard(CrossLayerGuard, Protocol):
    """A cross-layer guard that also splits the cache's budget over the layers: after ``prepare``,
    ``layer_scale(state)`` is the factor of this layer's budget relative to an even split ([B]
    float, the factors of one row averaging 1 over the layers prepare saw), or None for an even
    split. The pipeline writes it into the layer's ``extras[LAYER_SCALE]`` at the layer's first
    compression, and every later budget of that layer (decode time, another pipeline instance)
    reads it from there."""

    def layer_scale(self, state: KVState) -> Tensor | None:
        ...


@runtime_checkable
class LayeredGuard(Protocol):
    """A guard whose slots depend on where the layer sits in the model: the pipeline asks it with
    ``for_layer(state, layer_idx)`` (the index ``Pipeline.compress`` was given; None when it was
    given none) instead of calling it. A cross-layer guard counts layers as ``prepare`` saw them."""

    def for_layer(self, state: KVState, layer_idx: int | None) -> Tensor:
        """Slots that must never be merged or dropped, [B, H, N] bool."""
        ...


@runtime_checkable
class PersistentGuard(Protocol):
    """A guard whose slots (when ``persistent`` is True) are marked once in ``stats["guarded"]``,
    so later compressions keep them without deciding again."""

    persistent: bool


@runtime_checkable
class LayerBudgeted(Protocol):
    """A clusterer whose per-head slot counts may differ within a layer (Ada-KV head budgets):
    ``budget_scope`` "layer" means the budget is met when the heads' counts sum to at most the
    layer's total; "head" (the default for every other clusterer) means each head meets its own."""

    budget_scope: str


def budget_scope_of(clusterer) -> str:
    if isinstance(clusterer, LayerBudgeted):
        scope = clusterer.budget_scope
        require(scope in ("head", "layer"), f"{type(clusterer).__name__}.budget_scope", scope, "'head' or 'layer'")
        return scope
    return "head"


@runtime_checkable
class DecodeScoped(Protocol):
    """A clusterer's decode-time scope: "tail" (only slots not yet compressed are clustered) or
    "all" (every clusterable slot, the default)."""

    decode_scope: str


@runtime_checkable
class FloorAware(Protocol):
    """A clusterer that knows the smallest cache one compression can reach."""

    def min_slots(self, valid: Tensor, chunk_ids: Tensor) -> Tensor:
        """valid: [B, H, N] bool; chunk_ids: [B, H, N] long -> [B, H] long."""
        ...


@runtime_checkable
class FitsComposedPlan(Protocol):
    """A merger that is applied once to the whole compression: the pipeline runs every round with
    its ``round_merger`` (plain bookkeeping: positions, protection, counts, stats), composes the
    rounds' plans into one plan over the input slots, and calls ``fit_plan`` once after the last
    round, so each final slot is fitted against the original member slots (e.g. ``fitted``)."""

    @property
    def round_merger(self) -> Merger:
        """The merger of every round (its slots are what ``fit_plan`` starts from)."""
        ...

    def fit_plan(self, state: KVState, parent: Tensor, merged: KVState, *, owned: bool = False) -> KVState:
        """state: the compression's input; parent: [B, H, N] long, the rounds' plans composed
        over ``state``'s slots (a plan as ``Merger`` takes); merged: the last round's state (the
        same slots as ``round_merger(state, parent)``) -> ``merged`` with its slots refitted.
        owned: ``merged`` is a state the rounds' merges made (not ``state``) and no one else reads:
        the merger may write into the tensors its ``round_merger`` made instead of copying them."""
        ...


@runtime_checkable
class MergesInPlace(Protocol):
    """A merger that can run a compression's rounds in place: ``merge_in_place`` applies a round's
    plan to a working state the pipeline owns, leaving merged and dropped slots where they stand as
    padding (log-size -inf, position -1) and writing only the representatives that gained members;
    ``compact`` gathers the valid slots once after the last round. The result is the state that
    merging (and compacting) round by round gives, for strategies that are ``HoleTolerant``."""

    def merge_in_place(self, work: KVState, parent: Tensor) -> KVState:
        """work: a state whose tensors the caller owns (written into); parent: [B, H, N] long over
        its slots -> the merged working state (same N)."""
        ...

    def compact(self, work: KVState) -> KVState:
        """The valid slots of ``work`` in slot order, heads padded at the end to the longest."""
        ...


@runtime_checkable
class HoleTolerant(Protocol):
    """A chunker, clusterer or guard that sees slots only through ``valid`` and slot order, when
    ``holes_ok`` is True: padding slots in the middle of a head (merged slots a round in place left
    where they stood) change nothing it decides, so the pipeline may run its rounds in place."""

    holes_ok: bool


@runtime_checkable
class AppendMonotone(Protocol):
    """A chunker whose floor (anchors + one slot per chunk) never drops when raw tokens are
    appended, when ``append_monotone`` is True (lets DecodeCompressor remember floors)."""

    append_monotone: bool


@runtime_checkable
class OpenTail(Protocol):
    """A chunker whose last run stays open until a boundary closes it (e.g. the delimiter
    chunker): decode-time tail compression then clusters only completed chunks first."""

    def open_tail_start(self, state: KVState, frontier: Tensor, window_start: Tensor) -> Tensor | None:
        """frontier, window_start: [B] long token positions -> [B] long: the first position of
        the run still open before the recent window (``frontier`` when none is closed), or
        None when the chunker cannot tell for this state."""
        ...


class ClusterPlan:
    """A clusterer's answer: the merge plan, whether more rounds may help, and any threshold."""

    __slots__ = ("parent", "done", "tau")

    def __init__(self, parent: Tensor, done: bool = True, tau: Tensor | None = None):
        self.parent = parent  # [B, H, N] long
        self.done = done  # True: the clusterer will not merge more in later rounds
        self.tau = tau  # [B, H] float or None
