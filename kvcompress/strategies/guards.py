"""Guards: slots that no clusterer may merge and no scorer may evict.

- ``never-merge``: fixed token spans and/or token ids (a user's "keep these exact" list);
- ``sentences``: whole sentences chosen once per sequence, shared by every head and layer, from
  signals of all layers (the question's attention, digit-bearing tokens, novelty); see
  ``kvcompress.strategies.sentences``.

A guard with ``prepare(states, budget, already)`` and ``prepared_for(state)`` (the
``kvcompress.protocols.CrossLayerGuard`` protocol) is prepared by ``Pipeline.prepare(states)`` with
the states of every layer before any layer is compressed (the transformers cache does this at the
end of the prefill; the pipeline's needs then include ``all_layers``); used alone on one layer, the
pipeline prepares it from that layer. A guard with ``persistent = True`` (``PersistentGuard``) has
its slots marked in ``stats["guarded"]``, so later compressions (decode time, another pipeline
instance) keep them without deciding again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..registry import register_guard
from ..types import KVState
from ..validation import check_choice, check_int, check_range, require
from .sentences import (
    SENTENCE_ENDS, literal_signal, novelty_signal, query_signal, select_sentences, sentence_ids, sentence_sum,
)

SIGNALS = ("query", "literal", "novelty")


def decided_for(ids: Tensor | None, state: KVState) -> bool:
    """True when a cross-layer guard's decision, made for token ids ``ids`` [B, T0], holds for
    ``state``: the same rows, whose first T0 tokens are those ids (later tokens were appended)."""
    if ids is None or state.token_ids is None or state.token_ids.shape[0] != ids.shape[0]:
        return False
    if state.token_ids.shape[1] < ids.shape[1]:
        return False
    return bool(torch.equal(state.token_ids[:, : ids.shape[1]].to(ids.device), ids))


@register_guard("never-merge")
@dataclass(frozen=True)
class NeverMergeGuard:
    """Protect tokens in ``spans`` ([start, end) token positions) and tokens whose id is in
    ``token_ids``, in every head and layer."""

    spans: tuple = ()
    token_ids: tuple = ()
    holes_ok = True  # sees slots through valid and slot order only (HoleTolerant: rounds in place)

    def __post_init__(self):
        spans = tuple(tuple(s) for s in self.spans)
        for s in spans:
            require(len(s) == 2 and all(isinstance(x, int) and x >= 0 for x in s) and s[0] <= s[1],
                    "spans", s, "[start, end) pairs of token positions with 0 <= start <= end")
        ids = tuple(self.token_ids)
        require(all(isinstance(i, int) and i >= 0 for i in ids), "token_ids", ids, "non-negative token ids")
        object.__setattr__(self, "spans", spans)
        object.__setattr__(self, "token_ids", ids)

    def __call__(self, state: KVState) -> Tensor:
        """[B, H, N] bool."""
        pos = state.positions  # [B, H, N]
        mask = torch.zeros_like(state.valid)
        for a, b in self.spans:
            mask |= (pos >= a) & (pos < b)
        if self.token_ids:
            require(state.token_ids is not None, "token_ids", None, "token ids [B, T] in the state")
            ids = torch.as_tensor(self.token_ids, dtype=torch.long, device=pos.device)
            mask |= torch.isin(state.slot_token_ids(), ids)
        return mask & state.valid


@register_guard("sentences")
class SentenceGuard:
    """Keep whole sentences exact, chosen per sequence by ``signals`` and shared by all heads and layers.

    signals:     ranking signals, in order of precedence: "query" (attention of the last
                 ``query_window`` queries, needs query_window > 0), "literal" (digit-bearing
                 tokens), "novelty" (unlike the neighbouring sentences)
    share:       fraction of the budget (slots per head) the chosen sentences may take; each
                 signal may use an equal part of what the earlier ones left
    skip_layers: first layers left out of the query signal
    radius:      sentences either side that the novelty signal compares with
    ends:        characters that end a sentence
    """

    persistent = True

    def __init__(self, signals: Sequence[str] = ("query", "literal"), share: float = 0.4, skip_layers: int = 2,
                 radius: int = 8, ends: Sequence[str] = SENTENCE_ENDS):
        signals = (signals,) if isinstance(signals, str) else tuple(signals)
        require(len(signals) > 0 and len(set(signals)) == len(signals), "signals", signals,
                f"a non-empty list of distinct names from {SIGNALS}")
        for s in signals:
            check_choice("signals[]", s, SIGNALS)
        check_range("share", share, 0.0, 1.0)
        check_int("skip_layers", skip_layers, 0)
        check_int("radius", radius, 1)
        ends = tuple(ends)
        require(len(ends) > 0 and all(isinstance(e, str) and e for e in ends), "ends", ends,
                "non-empty strings that end a sentence")
        self.signals, self.share, self.skip_layers, self.radius, self.ends = signals, float(share), skip_layers, \
            radius, ends
        self._ids: Tensor | None = None  # [B, T0] the sequence the decision was made for
        self._keep: Tensor | None = None  # [B, T0] bool tokens of the chosen sentences

    def __repr__(self) -> str:
        return f"SentenceGuard(signals={self.signals}, share={self.share})"

    # ------------------------------------------------------------------ the decision
    def prepared_for(self, state: KVState) -> bool:
        return decided_for(self._ids, state)

    def prepare(self, states: Sequence[KVState], budget: Tensor, already: Tensor) -> None:
        """Choose the sentences for this sequence.

        states:  one KVState per layer (same tokens); budget: [B] slots per head;
        already: [B, T] bool tokens protected anyway (sinks, recent window)
        """
        first = states[0]
        require(first.token_ids is not None and first.vocab is not None, "state", "no token ids or vocab",
                "token ids [B, T] and the vocabulary's token texts: sentences are cut at token text")
        ids = first.token_ids
        sid = sentence_ids(ids, first.vocab, self.ends)  # [B, T]
        num = int(sid.max()) + 1
        free = (~already).float()
        lengths = sentence_sum(free, sid, num)  # [B, S] tokens a sentence would add
        padding = ids < 0
        eligible = lengths > 0
        left = torch.floor(budget.to(torch.float64) * self.share).long().to(ids.device)  # [B]
        chosen = torch.zeros_like(eligible)
        for i, name in enumerate(self.signals):
            scores = self._signal(name, states, sid, num)
            part = left // (len(self.signals) - i)
            pick = select_sentences(scores, lengths, part, eligible & ~chosen)
            left = left - (lengths * pick).sum(-1).long()
            chosen |= pick
        keep = chosen.gather(1, sid) & ~padding
        self._ids, self._keep = ids.clone(), keep

    def _signal(self, name: str, states, sid: Tensor, num: int) -> Tensor:
        if name == "query":
            return query_signal(states, sid, num, self.skip_layers)
        if name == "literal":
            return literal_signal(states[0].token_ids, states[0].vocab, sid, num)
        return novelty_signal(states, sid, num, self.radius)

    def chosen_tokens(self) -> Tensor | None:
        """[B, T0] bool: tokens of the chosen sentences (None before ``prepare``)."""
        return self._keep

    # ------------------------------------------------------------------ the guard
    def __call__(self, state: KVState) -> Tensor:
        """[B, H, N] bool: slots holding a token of a chosen sentence (nothing when not prepared
        for this sequence: slots marked by an earlier compression are protected by the pipeline)."""
        if not self.prepared_for(state):
            return torch.zeros_like(state.valid)
        keep = self._keep.to(state.positions.device)
        pos = state.positions  # [B, H, N]
        B, H, N = pos.shape
        inside = (pos >= 0) & (pos < keep.shape[1])
        hit = keep.gather(1, pos.clamp(0, keep.shape[1] - 1).reshape(B, H * N)).view(B, H, N)
        return hit & inside & state.valid
