"""Sentences as units of keep/merge decisions, and the signals that rank them.

Facts live in sentences: a needle "The special magic number is 9577766." is answered only when
the whole sentence survives, in every head and layer (protecting single tokens per head leaves the
number cut short). These helpers cut the token stream into sentences and score each one:

- ``query_signal``: how strongly the last queries (the question, when it is in the prompt) attend
  to the sentence: per (layer, head) the largest attention probability any window query gives
  any token of the sentence, summed over heads and layers;
- ``literal_signal``: how many tokens of the sentence carry a digit (numbers, dates, codes, ids:
  content that cannot be paraphrased back from the gist);
- ``novelty_signal``: how unlike its neighbouring sentences the sentence's mean value vector is.

``select_sentences`` then picks, per batch row, the best-scored sentences whose tokens fit an
allowance. All functions are pure tensors in, tensors out.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import Tensor

from ..types import KVState
from ..validation import require
from .scorers import late_start

SENTENCE_ENDS = (".", "!", "?", "\n")

_TABLES: dict = {}  # (id(vocab), chars) -> (vocab, table): keyed by identity, hashing 49k strings costs ms


def vocab_table(vocab: Sequence[str], chars: tuple[str, ...] | None, digits: bool = False) -> Tensor:
    """[V] bool: token text contains one of ``chars`` (or, with ``digits``, a decimal digit)."""
    key = (id(vocab), chars, digits)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is vocab:
        return hit[1]
    if digits:
        table = torch.tensor([any(c.isdigit() for c in text) for text in vocab], dtype=torch.bool)
    else:
        table = torch.tensor([any(c in text for c in chars) for text in vocab], dtype=torch.bool)
    if len(_TABLES) > 32:
        _TABLES.clear()
    _TABLES[key] = (vocab, table)  # the reference keeps id(vocab) from being reused while cached
    return table


def lookup(table: Tensor, token_ids: Tensor) -> Tensor:
    """table[token_ids] with ids outside the table (padding -1, unknown ids) read as False, on
    token_ids' device (the tables are built on the CPU; the [V] bool copy is cheap beside a prefill)."""
    table = table.to(token_ids.device)
    inside = (token_ids >= 0) & (token_ids < table.numel())
    return table[token_ids.clamp(0, table.numel() - 1)] & inside


def sentence_ids(token_ids: Tensor, vocab: Sequence[str], ends: tuple[str, ...] = SENTENCE_ENDS) -> Tensor:
    """[B, T] long: sentence index of every token; a sentence ends with (includes) a token whose
    text contains one of ``ends``. token_ids: [B, T]."""
    require(token_ids.dim() == 2, "token_ids", tuple(token_ids.shape), "a [B, T] tensor")
    is_end = lookup(vocab_table(vocab, tuple(ends)), token_ids).long()  # [B, T]
    return is_end.cumsum(-1) - is_end  # exclusive: the ender belongs to its sentence


def sentence_sum(x: Tensor, sid: Tensor, num: int) -> Tensor:
    """[..., S]: x [..., T] summed per sentence (sid [B, T] broadcast over the middle dims)."""
    out = x.new_zeros(*x.shape[:-1], num)
    return out.scatter_add_(-1, sid.expand_as(x), x)


def slot_sentences(state: KVState, sid: Tensor) -> Tensor:
    """[B, H, N] long: sentence of each slot's representative token (0 for padding)."""
    pos = state.positions.clamp(min=0, max=sid.shape[1] - 1)  # [B, H, N]
    B, H, N = pos.shape
    return sid.gather(1, pos.reshape(B, H * N)).view(B, H, N)


def query_signal(states: Sequence[KVState], sid: Tensor, num: int, skip_layers: int = 2) -> Tensor:
    """[B, S]: attention the window queries give each sentence, summed over heads and layers.

    Each state needs ``extras["queries"]`` [B, Hq, W, D] (the last W queries, rotated). Per
    (layer, head) a sentence scores the largest probability any query gives any of its tokens:
    the question's attention lands on a few tokens of the relevant sentence (often its start), so
    a sum over the sentence would favour long sentences. The first ``skip_layers`` layers attend
    by position more than by content and are left out (unless there are no others).
    """
    out = torch.zeros(sid.shape[0], num, dtype=torch.float32, device=sid.device)
    for st, att in window_attention(list(states[skip_layers:]) or list(states)):
        out += per_head_max(att, slot_sentences(st, sid), num).sum(1)
    return out


def window_attention(states: Sequence[KVState]) -> Iterator[tuple[KVState, Tensor]]:
    """(state, ``max_attention`` of its window queries [B, H, N]) for every state in turn, the
    states' ``extras["queries"]`` checked, the logits of every layer in one scratch buffer."""
    scratch = None
    for st in states:
        q = st.extras.get("queries")
        require(q is not None and q.dim() == 4 and q.shape[2] > 0, "extras['queries']",
                None if q is None else tuple(q.shape),
                "the last queries of every layer [B, Hq, W, D]: set query_window > 0 in the pipeline config")
        B, Hq, W, _ = q.shape
        size = B * Hq * W * st.num_slots
        if scratch is None or scratch.numel() < size or scratch.device != q.device:
            scratch = torch.empty(size, dtype=torch.float32, device=q.device)
        yield st, max_attention(st, q, scratch)


def max_attention(st: KVState, q: Tensor, out: Tensor | None = None) -> Tensor:
    """[B, H, N]: the largest attention probability any query of ``q`` [B, Hq, W, D] gives each slot
    (GQA: the G = Hq / H query heads of a KV head count as queries of it).

    One matmul of the [B, H, G * W, D] query rows with the keys (an einsum over [B, H, G, W, D]
    went through a slower batched path: 8k slots, 30 layers: 0.25 instead of 0.35 s). Blocks of
    query rows were tried and are slower: each block reads all the keys again.

    out: an optional float32 scratch of at least B * H * G * W * N elements, reused across layers
    (the [B, H, G * W, N] logits: 9 MB at 8k, whose fresh pages cost more than their product
    here); the softmax is taken in place in it (the same numbers)."""
    B, Hq, W, D = q.shape
    H, N = st.num_heads, st.num_slots
    G = Hq // H
    qk = (q.reshape(B, H, G * W, D).float(), st.keys.float().transpose(-1, -2))
    if out is None:
        logits = torch.matmul(*qk)  # [B, H, G*W, N]
    else:
        logits = torch.matmul(*qk, out=out.view(-1)[:B * H * G * W * N].view(B, H, G * W, N))
    # in place: the same numbers as out-of-place ops, without more [B, H, G * W, N] buffers
    logits.div_(math.sqrt(D)).add_(st.log_sizes[:, :, None, :])
    # query w sits at token T - W + w and sees only slots at or before it
    qpos = st.num_tokens - W + torch.arange(W, device=q.device)  # [W]
    # only slots after the first query's token can be in a query's future: mask from the
    # first column holding one (the last W columns of a prefill), not the whole [.., N]
    n0 = late_start(st.positions, qpos[0])
    if n0 < N:
        future = st.positions[:, :, None, n0:] > qpos.repeat(G)[None, None, :, None]  # row g * W + w: query w
        logits[..., n0:].masked_fill_(future, float("-inf"))
    return torch.softmax(logits, -1, out=logits).nan_to_num_(0.0).amax(2)  # [B, H, N]


def per_head_max(x: Tensor, slot_sid: Tensor, num: int) -> Tensor:
    """[B, H, S]: x [B, H, N] maximum per sentence and head; slot_sid [B, H, N]."""
    out = x.new_zeros(*x.shape[:2], num)
    return out.scatter_reduce_(-1, slot_sid, x, "amax", include_self=True)


def literal_signal(token_ids: Tensor, vocab: Sequence[str], sid: Tensor, num: int) -> Tensor:
    """[B, S]: tokens per sentence whose text holds a decimal digit. token_ids, sid: [B, T]."""
    has_digit = lookup(vocab_table(vocab, None, digits=True), token_ids).float()  # [B, T]
    return sentence_sum(has_digit, sid, num)


def novelty_signal(states: Sequence[KVState], sid: Tensor, num: int, radius: int = 8) -> Tensor:
    """[B, S]: 1 - cosine between a sentence's mean (centred, unit) value vector and the mean of
    the ``radius`` sentences either side, averaged over heads and layers. Needs uncompressed
    states (one slot per token, slot i = token i)."""
    B = sid.shape[0]
    idx = torch.arange(num, device=sid.device)
    lo, hi = (idx - radius).clamp(min=0), (idx + radius + 1).clamp(max=num)
    count = sentence_sum(torch.ones_like(sid, dtype=torch.float32), sid, num)  # [B, S]
    out = torch.zeros(B, num, dtype=torch.float32, device=sid.device)
    for st in states:
        require(st.num_slots == sid.shape[1], "states", f"{st.num_slots} slots for {sid.shape[1]} tokens",
                "uncompressed states for the novelty signal")
        v = st.values.float()  # [B, H, T, D]
        v = torch.nn.functional.normalize(v - v.mean(2, keepdim=True), dim=-1)
        H, D = v.shape[1], v.shape[3]
        sums = v.new_zeros(B, H, num, D).scatter_add_(2, sid[:, None, :, None].expand(B, H, -1, D), v)
        mean = sums / count[:, None, :, None].clamp(min=1)
        csum = torch.cat([mean.new_zeros(B, H, 1, D), mean.cumsum(2)], dim=2)
        around = (csum[:, :, hi] - csum[:, :, lo] - mean) / (hi - lo - 1).clamp(min=1)[None, None, :, None]
        out += (1 - torch.nn.functional.cosine_similarity(mean, around, dim=-1)).mean(1)
    return out / max(len(states), 1)


def select_sentences(scores: Tensor, lengths: Tensor, allowance: Tensor, eligible: Tensor | None = None) -> Tensor:
    """[B, S] bool: per row, sentences by descending score (score > 0) while their tokens fit.

    scores, lengths: [B, S]; allowance: [B] tokens; eligible: [B, S] bool or None.
    A sentence too long for what is left is skipped and the next one is tried, so one long
    sentence cannot block the rest. Runs once per sequence over S sentences (not per token).
    """
    require(scores.dim() == 2 and tuple(lengths.shape) == tuple(scores.shape), "lengths",
            tuple(lengths.shape), f"a [B, S] tensor shaped like scores {tuple(scores.shape)}")
    require(tuple(allowance.shape) == (scores.shape[0],), "allowance", tuple(allowance.shape),
            f"a [B] tensor, B = {scores.shape[0]}")
    ok = (scores > 0) & (lengths > 0)
    if eligible is not None:
        ok &= eligible
    order = torch.where(ok, scores, float("-inf")).argsort(dim=-1, descending=True, stable=True)  # [B, S]
    chosen = torch.zeros_like(ok)
    for b in range(scores.shape[0]):
        left = float(allowance[b])
        row_ok, row_len = ok[b].tolist(), lengths[b].tolist()
        for i in order[b].tolist():
            if not row_ok[i]:
                break  # the rest of the ranking is ineligible
            if row_len[i] <= left:
                chosen[b, i] = True
                left -= row_len[i]
    return chosen
