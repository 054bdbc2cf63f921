"""Question-free importance from the model itself: the reconstruction scorer, Ada-KV per-head
budgets and the importance sentence guard.

The statistic ``"reconstruction"`` ([B, H, N] float32 per slot, summed over members when slots
merge) is written by the reconstruction pass (``kvcompress.hf.reconstruct``: the model reads a
"repeat the previous context" prompt and the context again over the cache; a slot scores the
largest attention any of those queries gives it, over the query heads of its KV group). Pure
torch here: these strategies only read it.

- scorer ``reconstruction``: that statistic (KVzip's score, with the ``evict`` clusterer);
- ``adaptive_keep``: Ada-KV's selection, one top-k over all heads of a layer so that heads whose
  importance is spread keep more (per-head budgets summing to the layer's budget);
- guard ``importance``: whole sentences ranked by reconstruction importance summed over every
  layer and head (optionally with the sentences' prefill surprisal, ``surprisal=w``), kept exact
  in every head and layer (facts live in sentences; a number cut in half in one head is lost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..budget import target_slots
from ..protocols import Needs
from ..registry import register_guard, register_scorer
from ..types import KVState
from ..validation import check_choice, check_int, check_range, require
from .sentences import (SENTENCE_ENDS, per_head_max, select_sentences, sentence_ids,
                        sentence_sum, slot_sentences, window_attention)
from .guards import decided_for

STAT = "reconstruction"
SURPRISAL = "surprisal"  # extras [B, T] float32: each context token's prefill surprisal (kvcompress.hf.reconstruct)
COPY = "reconstruction_copy"  # extras [B, H] float32 per layer: each KV head's copy score (kvcompress.hf.reconstruct)
REDUCES = ("mean", "sum", "max", "median")
QUERY_WINDOW = 32  # the guard's query_share: last queries of each layer it asks the cache to record
HEAD_BUDGETS = ("uniform", "adaptive")
# tokens the reconstruction pass reconstructs per chunk (kvcompress.hf.reconstruct reads it from here): the
# queries of a chunk starting at context position s sit after the whole cache, so the tokens of one chunk are
# all copied from one distance (T + prompt - s), the first chunk's from the farthest
RECONSTRUCTION_CHUNK = 512


def reconstruction_stat(state: KVState, who: str = "reconstruction scorer") -> Tensor:
    """[B, H, N] float32: the state's reconstruction statistic; a ValueError saying how to get it."""
    x = state.stats.get(STAT)
    require(x is not None, f"{who}: state.stats[{STAT!r}]", None,
            "reconstruction scores of the layer: they come from a model pass after the prefill "
            "(kvcompress.hf.reconstruct; CompressedCache.for_model(model, tokenizer, ...) runs it); a pipeline used "
            "without model access cannot compute them")
    require(isinstance(x, Tensor) and tuple(x.shape) == tuple(state.log_sizes.shape), f"{who}: {STAT}",
            tuple(getattr(x, "shape", ())), f"a [B, H, N] tensor of shape {tuple(state.log_sizes.shape)}")
    return x.float()


def surprisal_of(state: KVState, num_tokens: int, who: str = "importance guard") -> Tensor:
    """[B, T] float32: the context tokens' prefill surprisal (extras["surprisal"]); a ValueError
    saying how to get it."""
    x = state.extras.get(SURPRISAL)
    require(x is not None, f"{who}: state.extras[{SURPRISAL!r}]", None,
            "each context token's prefill surprisal: a strategy declaring Needs(surprisal=True) gets it from the "
            "model pass at the prefill's end (kvcompress.hf.reconstruct.prefill_surprisal; "
            "CompressedCache.for_model(model, tokenizer, ...) runs it)")
    require(isinstance(x, Tensor) and x.dim() == 2 and x.shape[0] == state.batch_size and x.shape[1] >= num_tokens,
            f"{who}: {SURPRISAL}", tuple(getattr(x, "shape", ())),
            f"a [B={state.batch_size}, T >= {num_tokens}] tensor (one value per context token)")
    return x[:, :num_tokens].float()


def copy_of(state: KVState, who: str = "importance guard") -> Tensor:
    """[B, H] float32: the layer's per-KV-head copy scores (extras["reconstruction_copy"]); a
    ValueError saying how to get them."""
    x = state.extras.get(COPY)
    require(x is not None, f"{who}: state.extras[{COPY!r}]", None,
            "each KV head's copy score from the reconstruction pass (kvcompress.hf.reconstruct; "
            "CompressedCache.for_model(model, tokenizer, ...) runs it)")
    require(isinstance(x, Tensor) and tuple(x.shape) == (state.batch_size, state.num_heads), f"{who}: {COPY}",
            tuple(getattr(x, "shape", ())), f"a [B={state.batch_size}, H={state.num_heads}] tensor")
    return x.float()


MIN_LAYER_SCALE = 0.5  # copy_layer_scale: the least a layer gives to the copy layers (half its even share)


def split_layers(copy_layers: int, layers: int, scale: float) -> tuple[float, float] | None:
    """(copy layers' factor, other layers' factor) of an even split's budget, averaging 1 over
    ``layers``: the copy layers ``scale`` (lowered until the others keep ``MIN_LAYER_SCALE``);
    None when no layer or every layer holds a copy head (nothing to move)."""
    c, L = copy_layers, layers
    if c == 0 or c >= L:
        return None
    hi = min(scale, (L - MIN_LAYER_SCALE * (L - c)) / c)
    return hi, (L - c * hi) / (L - c)


def room_factor(budget: Tensor, scale: Tensor | float, protected: Tensor, full_room: Tensor) -> Tensor:
    """[B] float64 in [0, 1]: the room a layer at ``scale`` times the even ``budget`` [B] leaves beside
    the ``protected`` [B] slots (which do not shrink), relative to the even split's ``full_room`` [B]."""
    smaller = (torch.floor(budget.to(torch.float64) * scale) - protected).clamp(min=0)
    return (smaller / full_room.clamp(min=1)).clamp(max=1.0)


def ranks01(x: Tensor, eligible: Tensor) -> Tensor:
    """[B, S] float32 in [0, 1]: each eligible entry's rank among the eligible entries of its row
    (1 = highest; ties broken by index), 0 for the others. x, eligible: [B, S]."""
    key = torch.where(eligible, x.float(), float("-inf"))
    rank = key.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True).float()  # 0 = lowest
    n = eligible.sum(-1, keepdim=True).float()
    # the ineligible entries (-inf) take the lowest ranks: shift them away
    out = (rank - (x.shape[-1] - n)) / (n - 1).clamp(min=1)
    return torch.where(eligible, out.clamp(min=0.0), torch.zeros((), dtype=out.dtype, device=out.device))


@register_scorer("reconstruction")
@dataclass(frozen=True)
class ReconstructionScorer:
    """KVzip's importance: the largest attention a slot receives from the queries of a
    context-reconstruction pass (max over the query heads of its KV group). A merged slot scores
    the sum of its members' scores. Needs the model pass (``needs.model_pass``)."""

    needs = Needs(model_pass=True)

    def __call__(self, state: KVState) -> Tensor:
        return reconstruction_stat(state)


# ---------------------------------------------------------------------------- Ada-KV
def adaptive_keep(scores: Tensor, free: Tensor, quota: Tensor, head_floor: float = 0.2,
                  rectangular: bool = False) -> Tensor:
    """[B, H, N] bool: Ada-KV's per-head budgets, one top-k over all heads of a layer.

    scores: [B, H, N] (higher = keep); free: [B, H, N] bool candidates; quota: [B, H] long slots
    each head would keep under a uniform budget. Each head first keeps its best
    floor(quota * head_floor) candidates (Ada-KV's safeguard); the rest of the layer's budget,
    sum_h quota - what the floors took, goes to the best remaining candidates of any head. The
    kept count per (b, head) varies; its sum over heads equals sum_h quota (or every candidate,
    when fewer).

    rectangular: the padded tensor counts toward the budget (no head above its quota): the one
    score threshold over the layer is lowered only until the first head reaches its quota, so
    every head keeps at most its quota and the layer tensor (padded to its longest head) is the
    uniform budget. Each head then keeps a best-first prefix of what uniform selection keeps.
    """
    from .eviction import rank_desc

    check_range("head_floor", head_floor, 0.0, 1.0)
    B, H, N = scores.shape
    quota = quota.to(scores.device).long()
    floor = torch.floor(quota.double() * head_floor + 1e-9).long()[..., None]  # [B, H, 1]
    keep = free & (rank_desc(scores, free) < floor)
    rest = free & ~keep
    if rectangular:
        if N == 0:
            return keep
        need = (quota[..., None] - floor).clamp(min=0)  # [B, H, 1] slots each head may still take
        rank = rank_desc(scores, rest)
        key = torch.where(rest, scores.float().nan_to_num(nan=float("-inf")), float("-inf"))
        order = key.sort(-1, descending=True).values  # [B, H, N]
        fills = (need > 0) & (rest.sum(-1, keepdim=True) >= need)  # heads that can reach their quota
        at = torch.where(fills, order.gather(-1, (need - 1).clamp(min=0)), float("-inf"))
        thr = at.amax(dim=1, keepdim=True)  # [B, 1, 1]: the first head to fill decides
        return keep | (rest & (rank < need) & (key >= thr))
    left = (quota.sum(-1) - keep.sum(dim=(1, 2))).clamp(min=0)  # [B]
    ranks = rank_desc(scores.reshape(B, 1, H * N), rest.reshape(B, 1, H * N)).view(B, H, N)
    return keep | (rest & (ranks < left[:, None, None]))


# ---------------------------------------------------------------------------- the sentence guard
@register_guard("importance")
class ImportanceGuard:
    """Keep whole sentences exact, ranked by reconstruction importance, the same in every head and layer.

    share:  fraction of the budget left after sinks and the recent window that the chosen
            sentences may take
    token_share: fraction of that budget that each (layer, KV head) gives to its own best tokens
            by reconstruction score (KVzip's per-head choice), on top of the sentences
    window_share: fraction of that budget that each (layer, KV head) gives to the tokens the last
            prompt queries attend to most (SnapKV's score, kernel 7; needs query_window > 0), after
            the sentences and the per-head tokens: what the text right before the next input needs
    head_budget: how ``token_share`` is split over the KV heads of a layer: "uniform" (each head
            its share) or "adaptive" (Ada-KV: one top-k over all heads of the layer, so heads whose
            importance is concentrated give tokens to the others; a head takes at most twice its
            share). The merger still fills every head to the same slot count, so the layer tensor
            stays rectangular at the budget: the per-head budget is of exact tokens, not of memory
    reduce: a sentence's score from its tokens' importance (importance of a token = its
            reconstruction score summed over every layer and KV head): "mean" (importance per
            token of budget spent), "sum", "max" or "median" (not moved by one delimiter token
            that draws sink-like attention)
    surprisal: weight w of the sentences' prefill surprisal (mean over their tokens of
            -log p(token | what precedes), the model's own "I could not have guessed this"; needs
            ``Needs(surprisal=True)``): with w > 0 a sentence ranks by
            rank(importance) + w * rank(surprisal), ranks in [0, 1] among the candidate
            sentences, so neither signal's scale matters. 0: importance alone
    copy_heads: share in (0, 1] of the (layer, KV head) pairs that keep the chosen sentences: those
            with the highest copy score of the reconstruction pass (extras["reconstruction_copy"]:
            how much a reconstruction query attends to the very token it reproduces; the few
            "retrieval" heads, RazorAttention / DuoAttention). Every other head gives the sentences'
            allowance to its own best tokens by reconstruction score (``other_token_share``).
            1: every head keeps the sentences (the copy score is not read)
    query_share: share of the sentences' allowance given first to the sentences the last
            ``query_window`` queries attend to most (``window_signal``: per (layer, KV head) the
            largest probability any window query gives a token of the sentence, over the tokens
            the guard may choose, i.e. not the sinks or the recent window, summed over the
            ``query_heads`` share of heads with the highest copy score, layers after the first
            two); a question inside the prompt points at its answer, which the question-free
            ranking may miss. The rest of the allowance goes to the ranking above. Needs
            ``query_window`` > 0 (asked for: 32)
    query_heads: share in (0, 1] of the (layer, KV head) pairs whose window attention
            ``query_share`` reads: those with the highest copy score (the heads that retrieve by
            content; the others attend by proximity, to the text just before the window). 1: all
    other_token_share: with ``copy_heads`` < 1, the share of the budget the heads without
            sentences give to their own best tokens by reconstruction score (the rest of their
            budget: SnapKV's choice and merging); None: share + token_share (the whole allowance)
    band:   0: a token's importance as the pass gives it. n > 0: divided by the median importance
            of the tokens the guard may choose (not the sinks or the recent window) among context
            positions [k n, (k + 1) n) holding it (``band_relative``). The pass reconstructs the
            context chunk by chunk (``RECONSTRUCTION_CHUNK`` tokens) with every chunk's queries after
            the whole cache, so a chunk's tokens are copied from one distance, the first chunk's
            from the farthest; on a 4k context the attention the early chunks receive is several
            times lower for that reason alone (dev, results/issue18-dev7), and sentences are then
            ranked by where they are rather than by what they say. With ``band`` equal to the
            pass's chunk each token is compared with the tokens copied from its own distance
    allowance_keep: None: the allowances above are shares of the room the budget leaves. A keep
            ratio k: they are shares of the room a budget of k of the tokens seen would leave, at
            most the budget's own: above keep k the extra slots go to the clusterer's choice
            (SnapKV's window in the D2O presets) and to the adaptive heads' cap, not to more
            sentences or more reconstruction-ranked tokens. The importance signal finds the facts
            a small cache must hold; once they fit, what the continuation needs next is read
            better from the window queries (dev, results/issue18-s14)
    fill_share: with ``allowance_keep``, the share of the slots a larger budget adds above that
            cap (its room minus the capped room) that each (layer, KV head) gives to its own best
            tokens by reconstruction score (KVzip's choice, split over the heads as
            ``head_budget`` says), on top of ``token_share``; the rest of them stays with the
            clusterer's choice. 0: all of them with the clusterer's choice. At or below keep
            ``allowance_keep`` it changes nothing
    copy_layer_scale: with ``copy_heads`` < 1, the budget of a layer holding a copy head relative to
            an even split over the layers (``LayerBudgetGuard``); the other layers keep less, so the
            cache's size is the budget's (c copy layers of L: the others keep
            (L - c * scale) / (L - c), at least ``MIN_LAYER_SCALE``; ``scale`` is lowered to fit).
            The allowances stay those of an even split, so the extra slots of a copy layer go to
            the clusterer's choice (SnapKV's window in the D2O presets): the copy heads keep their
            sentences and what the continuation needs from them, which the sentences displaced. In
            the other layers the per-head quotas shrink with the room the layer's budget leaves.
            1: an even split (no layer scale)
    copy_sentence_scale: with ``copy_layer_scale`` > 1, the sentences' allowance of the copy heads
            relative to an even split's, in [1, ``copy_layer_scale``] (lowered with the copy layers'
            factor when that is lowered to fit): part of a copy layer's extra room holds more ranked
            sentences, the rest goes to the clusterer's choice as above. The sentences' allowance
            bounds the facts a question-free cache can hold, and a needle ranked just past it is
            lost (results/issue18-s29). The other heads' quotas stay an even split's. 1: the even
            split's allowance
    upper_share: with ``copy_heads`` < 1, the share of its own tokens' quota that a head without
            sentences, in a layer from ``upper_from`` on, gives to the best-ranked of the chosen
            sentences (the same few in every such head, exact; the rest of the quota stays its own
            best tokens). A question-free cache whose needle the copy heads held could still not
            answer near 4k: the answer is read through many heads of the upper half, and hiding it
            there alone lost it (results/issue18-s30/probe). 0: sentences in the copy heads only
    upper_from: the first layer ``upper_share`` reaches, as a share of the layers ``prepare`` saw
            (0.5: the upper half); a layer whose index the pipeline was not given is not reached
    lead:   the lead-in the reconstruction pass gives every chunk after the first (``Needs.pass_lead``;
            0: KVzip's chunks, none). The pass feeds "repeat prompt + chunk", so a chunk's first
            tokens are reproduced before the model has found where in the context it is copying
            from, and a fact at a chunk's start is ranked down for where it sits (results/issue18-s16dev);
            with the L tokens before the chunk teacher-forced first, its tokens are copied mid-stream
    aligned: the reconstruction pass places every chunk where one full repeat of the context would
            (``Needs.pass_aligned``; False: every chunk right after the cache, as KVzip's chunks). There
            the last chunk is copied from the nearest text, every token of it with high attention, and a
            fact near the context's end stands out no more: a needle at depth 0.9 ranked 29th-52nd of ~200
            sentences, 13th-25th aligned (PG 2k, results/issue18-s18)
    ends:   characters that end a sentence

    Sentences are picked best first while their tokens (those not protected anyway: sinks, recent
    window) fit the allowance; a sentence too long for what is left is skipped. Decided once per
    sequence from every layer (``prepare``: a ``CrossLayerGuard``) and remembered by the cache
    (``persistent``).
    """

    persistent = True

    def __init__(self, share: float = 0.5, reduce: str = "mean", token_share: float = 0.0,
                 window_share: float = 0.0, head_budget: str = "uniform", surprisal: float = 0.0,
                 copy_heads: float = 1.0, other_token_share: float | None = None, query_share: float = 0.0,
                 query_heads: float = 1.0, band: int = 0, allowance_keep: float | None = None,
                 lead: int = 0, aligned: bool = False, fill_share: float = 0.0,
                 copy_layer_scale: float = 1.0, copy_sentence_scale: float = 1.0,
                 upper_share: float = 0.0, upper_from: float = 0.5,
                 ends: Sequence[str] = SENTENCE_ENDS):
        check_range("surprisal", surprisal, 0.0, 100.0)
        if allowance_keep is not None:
            check_range("allowance_keep", allowance_keep, 0.0, 1.0, lo_open=True)
        self.allowance_keep = None if allowance_keep is None else float(allowance_keep)
        check_range("fill_share", fill_share, 0.0, 1.0)
        require(fill_share == 0 or allowance_keep is not None, "fill_share", fill_share,
                "0 without allowance_keep (it shares out the slots above that cap)")
        self.fill_share = float(fill_share)
        check_range("copy_heads", copy_heads, 0.0, 1.0, lo_open=True)
        self.copy_heads = float(copy_heads)
        check_range("copy_layer_scale", copy_layer_scale, 1.0, 8.0)
        require(copy_layer_scale == 1.0 or copy_heads < 1.0, "copy_layer_scale", copy_layer_scale,
                "1 with copy_heads 1 (every layer holds the sentences: no layer to give more)")
        self.copy_layer_scale = float(copy_layer_scale)
        check_range("copy_sentence_scale", copy_sentence_scale, 1.0, 8.0)
        require(copy_sentence_scale <= copy_layer_scale, "copy_sentence_scale", copy_sentence_scale,
                f"at most copy_layer_scale = {copy_layer_scale:g} (the copy layers' extra room holds the extra sentences)")
        self.copy_sentence_scale = float(copy_sentence_scale)
        self._layer_scales: tuple[float, float] | None = None  # (copy layers', other layers') budget factor
        check_range("upper_share", upper_share, 0.0, 1.0)
        require(upper_share == 0 or copy_heads < 1.0, "upper_share", upper_share,
                "0 with copy_heads 1 (every head holds the sentences already)")
        check_range("upper_from", upper_from, 0.0, 1.0, lo_open=True)
        self.upper_share, self.upper_from = float(upper_share), float(upper_from)
        self._upper: Tensor | None = None  # [B, T] bool tokens of the sentences the upper layers' other heads hold
        self._upper_len: Tensor | None = None  # [B] their tokens (not protected anyway)
        self._upper_first = 0  # first layer index they reach
        check_range("query_share", query_share, 0.0, 1.0)
        self.query_share = float(query_share)
        check_range("query_heads", query_heads, 0.0, 1.0, lo_open=True)
        self.query_heads = float(query_heads)
        check_int("band", band, 0)
        self.band = int(band)
        check_int("lead", lead, 0)
        self.lead = int(lead)
        require(isinstance(aligned, bool), "aligned", aligned, "True or False")
        self.aligned = aligned
        if other_token_share is not None:
            check_range("other_token_share", other_token_share, 0.0, 1.0)
            require(other_token_share + window_share <= 1.0 + 1e-9, "other_token_share", other_token_share,
                    f"at most 1 - window_share = {1.0 - window_share:g} (one budget)")
        self.other_token_share = None if other_token_share is None else float(other_token_share)
        self._copy_thr: Tensor | None = None  # [B] lowest copy score of a sentence-keeping head
        self._allowance: Tensor | None = None  # [B] the sentences' allowance per head
        self._budget: Tensor | None = None  # [B] the even budget, protected slots and room prepare saw
        self._protected: Tensor | None = None
        self._full_room: Tensor | None = None
        self._other: Tensor | None = None  # [B] own tokens of a head without sentences
        self.surprisal = float(surprisal)
        check_range("share", share, 0.0, 1.0)
        check_range("token_share", token_share, 0.0, 1.0)
        check_range("window_share", window_share, 0.0, 1.0)
        require(share + token_share + window_share <= 1.0 + 1e-9, "token_share", token_share,
                f"at most 1 - share - window_share = {1.0 - share - window_share:g} (one budget for all three)")
        self.token_share, self.window_share = float(token_share), float(window_share)
        check_choice("head_budget", head_budget, HEAD_BUDGETS)
        self.head_budget = head_budget
        self._window: Tensor | None = None
        self._tokens: Tensor | None = None  # [B] tokens per head given to the per-head choice
        self._cap: Tensor | None = None  # [B] most tokens one head may take with head_budget="adaptive"
        check_choice("reduce", reduce, REDUCES)
        ends = tuple(ends)
        require(len(ends) > 0 and all(isinstance(e, str) and e for e in ends), "ends", ends,
                "non-empty strings that end a sentence")
        self.share, self.reduce, self.ends = float(share), reduce, ends
        self._ids: Tensor | None = None
        self._keep: Tensor | None = None

    def __repr__(self) -> str:
        return (f"ImportanceGuard(share={self.share}, reduce={self.reduce!r}, token_share={self.token_share}, "
                f"window_share={self.window_share}, head_budget={self.head_budget!r}, surprisal={self.surprisal}, "
                f"copy_heads={self.copy_heads}, other_token_share={self.other_token_share}, "
                f"query_share={self.query_share}, query_heads={self.query_heads}, band={self.band}, "
                f"allowance_keep={self.allowance_keep}, lead={self.lead}, aligned={self.aligned}, "
                f"fill_share={self.fill_share}, copy_layer_scale={self.copy_layer_scale}, "
                f"copy_sentence_scale={self.copy_sentence_scale}, upper_share={self.upper_share}, "
                f"upper_from={self.upper_from})")

    @property
    def needs(self) -> Needs:
        return Needs(model_pass=True, surprisal=self.surprisal > 0, pass_lead=self.lead, pass_aligned=self.aligned,
                     query_window=QUERY_WINDOW if self.query_share > 0 else 0)

    def prepared_for(self, state: KVState) -> bool:
        return decided_for(self._ids, state)

    def prepare(self, states: Sequence[KVState], budget: Tensor, already: Tensor) -> None:
        """states: one KVState per layer (same tokens, with the reconstruction statistic);
        budget: [B] slots per head; already: [B, T] bool tokens protected anyway."""
        first = states[0]
        require(first.token_ids is not None and first.vocab is not None, "state", "no token ids or vocab",
                "token ids [B, T] and the vocabulary's token texts: sentences are cut at token text")
        ids = first.token_ids[:, : first.num_tokens]
        B, T = ids.shape
        importance = token_importance(states, T)  # [B, T]
        sid = sentence_ids(ids, first.vocab, self.ends)
        num = int(sid.max()) + 1 if T else 1
        free = (~already[:, :T].to(ids.device)).float()
        if self.band:
            importance = band_relative(importance, free.bool(), self.band)
        lengths = sentence_sum(free, sid, num)
        if self.reduce == "max":
            score = importance.new_zeros(B, num).scatter_reduce_(-1, sid, importance, "amax", include_self=True)
        elif self.reduce == "median":
            score = sentence_median(importance, sid, num)
        else:
            score = sentence_sum(importance, sid, num)
            if self.reduce == "mean":
                score = score / sentence_sum(torch.ones_like(importance), sid, num).clamp(min=1)
        if self.surprisal > 0:
            surprise = sentence_sum(surprisal_of(first, T).to(ids.device), sid, num)
            surprise = surprise / sentence_sum(torch.ones_like(importance), sid, num).clamp(min=1)
            eligible = lengths > 0
            # + a hair so that the lowest-ranked candidate still counts as a candidate (score > 0)
            score = ranks01(score, eligible) + self.surprisal * ranks01(surprise, eligible) + 1e-6 * eligible
        # the allowance is what the budget leaves after the slots protected anyway (sinks, recent)
        protected = (~free.bool()).sum(-1)
        full_room = (budget.to(ids.device) - protected).clamp(min=0)
        room = full_room
        if self.allowance_keep is not None:
            capped = torch.minimum(budget.to(ids.device), target_slots(first.real_tokens().to(ids.device),
                                                                       self.allowance_keep, None))
            room = (capped - protected).clamp(min=0)
        allowance = torch.floor(room.to(torch.float64) * self.share).long()
        copy_thr, layer_scales = self._copy_split(states, ids.device)
        sentences = allowance  # what the chosen sentences may fill: the even split's, or more in copy layers
        if layer_scales is not None and self.copy_sentence_scale > 1.0:
            scale = min(self.copy_sentence_scale, layer_scales[0])
            sentences = torch.floor(room.to(torch.float64) * (self.share * scale)).long()
        eligible = lengths > 0
        chosen = torch.zeros_like(eligible)
        if self.query_share > 0:
            part = torch.floor(sentences.to(torch.float64) * self.query_share).long()
            signal = window_signal(states, sid, num, already[:, :T].to(ids.device), self.query_heads)
            chosen = select_sentences(signal, lengths, part, eligible & (signal > 0))
            eligible = eligible & ~chosen
        left = sentences - (lengths * chosen).sum(-1).long()
        chosen = chosen | select_sentences(score, lengths, left, eligible)
        self._ids, self._keep = ids.clone(), chosen.gather(1, sid) & (ids >= 0)
        # the slots above the allowance cap that go to each head's own reconstruction-ranked tokens
        fill = torch.floor((full_room - room).to(torch.float64) * self.fill_share).long()
        own = torch.floor(room.to(torch.float64) * self.token_share).long()
        self._tokens = own + fill
        self._window = torch.floor(room.to(torch.float64) * self.window_share).long()
        self._cap = (full_room - allowance - self._window).clamp(min=0)  # what sentences and window leave
        self._allowance = allowance
        self._budget, self._protected, self._full_room = budget.to(ids.device), protected, full_room
        self._other = fill + (allowance + own if self.other_token_share is None
                              else torch.floor(room.to(torch.float64) * self.other_token_share).long())
        self._copy_thr, self._layer_scales = copy_thr, layer_scales
        self._upper = self._upper_len = None
        if self.upper_share > 0 and copy_thr is not None:
            # sized for the smallest quota an upper layer's other head has (a layer that gave room)
            scale = 1.0 if layer_scales is None else min(layer_scales)
            quota = torch.floor(self._other.to(torch.float64) * room_factor(self._budget, scale, protected, full_room))
            upper = select_sentences(score, lengths, torch.floor(quota * self.upper_share).long(), chosen)
            self._upper = upper.gather(1, sid) & (ids >= 0)
            self._upper_len = (lengths * upper).sum(-1).long()
            self._upper_first = int(math.ceil(self.upper_from * len(states) - 1e-9))

    def _copy_split(self, states: Sequence[KVState], device) -> tuple[Tensor | None, tuple[float, float] | None]:
        """([B] the copy score a copy head reaches, or None when every head holds sentences;
        (copy layers' factor, other layers' factor) of an even split, or None for an even split)."""
        if self.copy_heads >= 1.0:
            return None, None
        x = torch.stack([copy_of(st) for st in states], 1)  # [B, L, H]
        k = int(math.ceil(self.copy_heads * x[0].numel() - 1e-9))
        thr = x.flatten(1).topk(k, dim=-1).values[:, -1].to(device)
        if self.copy_layer_scale <= 1.0:
            return thr, None
        # one split for every row, so that each row's cache is the budget's size: a layer holding a
        # copy head of any row is a copy layer
        copy_layers = (x >= thr.to(x.device)[:, None, None]).any(-1).any(0)  # [L]
        return thr, split_layers(int(copy_layers.sum()), len(states), self.copy_layer_scale)

    def chosen_tokens(self) -> Tensor | None:
        """[B, T0] bool: tokens of the chosen sentences (None before ``prepare``)."""
        return self._keep

    def layer_scale(self, state: KVState) -> Tensor | None:
        """[B] float: this layer's budget relative to an even split (``copy_layer_scale``), or
        None for an even split (scale 1, or not prepared for this state's sequence)."""
        if self._layer_scales is None or not self.prepared_for(state):
            return None
        hi, lo = self._layer_scales
        dev = state.keys.device
        copy_layer = bool((copy_of(state).to(dev) >= self._copy_thr.to(dev)[:, None]).any())
        return torch.full((state.batch_size,), hi if copy_layer else lo, dtype=torch.float64, device=dev)

    def __call__(self, state: KVState) -> Tensor:
        """[B, H, N] bool: slots holding a token of a chosen sentence (a layer of unknown place)."""
        return self.for_layer(state, None)

    def for_layer(self, state: KVState, layer_idx: int | None) -> Tensor:
        """[B, H, N] bool: slots holding a token of a chosen sentence, and (``upper_share``, layer
        ``layer_idx`` from ``upper_from`` on) of the best-ranked ones in the other heads."""
        if not self.prepared_for(state):
            return torch.zeros_like(state.valid)
        mask = _token_slots(self._keep, state)
        B, H, _ = mask.shape
        dev = mask.device
        tokens = self._tokens.to(dev)[:, None].expand(B, H)  # [B, H] exact tokens of each head's own choice
        cap = self._cap.to(dev)[:, None].expand(B, H)
        if self._copy_thr is not None:
            sentences = copy_of(state).to(dev) >= self._copy_thr.to(dev)[:, None]  # [B, H]
            mask &= sentences[..., None]
            other = self._other.to(dev)[:, None]
            # a head without sentences: its own tokens, within what the window leaves
            tokens = torch.where(sentences, tokens, other)
            cap = torch.where(sentences, cap, (self._cap + self._allowance).to(dev)[:, None])
            scale = self.layer_scale(state)
            if scale is not None and bool((scale < 1).any()):
                # a layer that gave room: its quotas shrink with the room its budget leaves beside
                # the slots protected anyway (which do not shrink)
                factor = room_factor(self._budget.to(dev), scale, self._protected.to(dev), self._full_room.to(dev))[:, None]
                tokens = torch.floor(tokens.to(torch.float64) * factor).long()
                cap = torch.floor(cap.to(torch.float64) * factor).long()
            if self._upper is not None and layer_idx is not None and layer_idx >= self._upper_first:
                # the other heads hold the best few sentences in place of as many of their own tokens
                wide = ~sentences
                mask |= _token_slots(self._upper, state) & wide[..., None]
                tokens = torch.where(wide, (tokens - self._upper_len.to(dev)[:, None]).clamp(min=0), tokens)
        if bool((tokens > 0).any()):
            from .eviction import rank_desc

            free = state.valid & ~mask
            scores = reconstruction_stat(state, "importance guard")
            rank = rank_desc(scores, free)
            if self.head_budget == "adaptive":
                capped = free & (rank < torch.minimum(2 * tokens, cap)[..., None])
                mask |= adaptive_keep(scores, capped, tokens, head_floor=0.0)
            else:
                mask |= free & (rank < tokens[..., None])
        if self.window_share > 0:
            from .eviction import rank_desc

            free = state.valid & ~mask
            rank = rank_desc(_window_scorer()(state), free)
            mask |= free & (rank < self._window.to(rank.device)[:, None, None])
        return mask


def _token_slots(tokens: Tensor, state: KVState) -> Tensor:
    """[B, H, N] bool: valid slots of ``state`` whose position is a True token of ``tokens`` [B, T0]."""
    keep = tokens.to(state.positions.device)
    pos = state.positions
    B, H, N = pos.shape
    inside = (pos >= 0) & (pos < keep.shape[1])
    hit = keep.gather(1, pos.clamp(0, keep.shape[1] - 1).reshape(B, H * N)).view(B, H, N)
    return hit & inside & state.valid


def window_signal(states: Sequence[KVState], sid: Tensor, num: int, already: Tensor,
                  heads: float = 1.0, skip_layers: int = 2) -> Tensor:
    """[B, S] float32: attention the window queries give each sentence, in the heads that retrieve.

    Each state needs ``extras["queries"]`` [B, Hq, W, D] (the last W queries, rotated) and, with
    ``heads`` < 1, ``extras["reconstruction_copy"]`` [B, H]. Per (layer, KV head) a sentence
    scores the largest probability any window query gives one of its tokens not in ``already``
    [B, T] (the sinks and the recent window: kept anyway, and the window's own text draws the
    local attention); summed over the share ``heads`` of (layer, KV head) pairs with the highest
    copy score (per row), layers from ``skip_layers`` on (unless there are no others)."""
    use = list(states[skip_layers:]) or list(states)
    B = sid.shape[0]
    picked = None
    if heads < 1.0:
        copy = torch.stack([copy_of(st, "importance guard (query_heads)") for st in use], 1).flatten(1)  # [B, L'H]
        k = int(math.ceil(heads * copy.shape[1] - 1e-9))
        picked = (copy >= copy.topk(k, dim=-1).values[:, -1:]).view(B, len(use), -1).to(sid.device)
    out = torch.zeros(B, num, dtype=torch.float32, device=sid.device)
    for i, (st, att) in enumerate(window_attention(use)):
        pos = st.positions.clamp(0, already.shape[1] - 1)
        skip = already.gather(1, pos.flatten(1)).view_as(pos) | (st.positions < 0) | (st.positions >= already.shape[1])
        att = att.masked_fill_(skip.to(st.keys.device), 0.0)
        per_head = per_head_max(att, slot_sentences(st, sid), num)  # [B, H, S]
        if picked is not None:
            per_head = per_head * picked[:, i, :, None]
        out += per_head.sum(1)
    return out


def band_relative(x: Tensor, free: Tensor, band: int) -> Tensor:
    """[B, T]: ``x`` [B, T] divided, per row, by the median of ``x`` over the ``free`` [B, T] bool
    tokens of its band (context positions [k band, (k + 1) band)); a band without free tokens,
    or whose median is not positive, is left as it is (divided by 1)."""
    B, T = x.shape
    if T == 0:
        return x
    k = torch.arange(T, device=x.device) // band  # [T]
    nb = int(k[-1]) + 1
    group = torch.where(free, k[None, :].expand(B, T), nb)  # the tokens not free: one extra group, ignored
    med = sentence_median(x, group, nb + 1)[:, :nb]  # [B, nb]
    med = torch.where(med > 0, med, torch.ones((), dtype=med.dtype, device=med.device))
    return x / med.gather(1, k[None, :].expand(B, T))


def sentence_median(x: Tensor, sid: Tensor, num: int) -> Tensor:
    """[B, S]: the (lower) median of ``x`` [B, T] over the tokens of each sentence (``sid`` [B, T]
    in [0, S)); 0 for a sentence without tokens. Two stable sorts group each sentence's tokens in
    ascending order; the median is read at its sentence's offset, no loop over sentences."""
    B, T = x.shape
    if T == 0:
        return x.new_zeros(B, num)
    by_value = x.argsort(dim=-1, stable=True)
    by_sentence = sid.gather(-1, by_value).argsort(dim=-1, stable=True)
    ordered = x.gather(-1, by_value.gather(-1, by_sentence))  # [B, T] grouped by sentence, ascending
    counts = sentence_sum(torch.ones_like(x), sid, num).long()  # [B, S]
    starts = counts.cumsum(-1) - counts
    mid = (starts + (counts - 1).clamp(min=0) // 2).clamp(max=T - 1)
    return torch.where(counts > 0, ordered.gather(-1, mid), torch.zeros((), dtype=x.dtype, device=x.device))


def token_importance(states: Sequence[KVState], num_tokens: int) -> Tensor:
    """[B, T] float32: reconstruction score of each token summed over every layer and KV head
    (a merged slot's score is given to its representative token)."""
    first = states[0]
    out = torch.zeros(first.batch_size, num_tokens, dtype=torch.float32, device=first.keys.device)
    for st in states:
        x = reconstruction_stat(st, "importance guard").masked_fill(~st.valid, 0.0)  # [B, H, N]
        pos = st.positions.clamp(0, num_tokens - 1).flatten(1)
        out.scatter_add_(1, pos, (x * (st.positions >= 0)).flatten(1))
    return out


def _window_scorer():
    """SnapKV's score (kernel 7) for the guard's ``window_share``."""
    from ..registry import SCORERS

    return SCORERS.create("snapkv", {"kernel_size": 7})
