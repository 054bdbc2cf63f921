"""Chunkers: which slots may be clustered together.

A chunker returns chunk ids [B, H, N] (long): slots with the same id may merge, -1 marks slots
that are never clustered (protected slots, anchors, padding).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import Tensor

from ..registry import register_chunker
from ..types import KVState
from ..validation import check_choice, check_int, require

DEFAULT_DELIMITERS = (".", ",", "?", "!", "\n", "\t")


def clusterable(state: KVState, protected: Tensor) -> Tensor:
    """[B, H, N] bool: valid slots that are not protected."""
    return state.valid & ~protected


@register_chunker("global")
@dataclass(frozen=True)
class GlobalChunker:
    """No chunking: every clusterable slot of a head is in one chunk (SemantiCache ablation)."""

    append_monotone = True  # appended raw tokens join the one chunk: the floor never drops
    holes_ok = True  # sees slots through valid and slot order only (HoleTolerant: rounds in place)

    def __call__(self, state: KVState, protected: Tensor) -> Tensor:
        free = clusterable(state, protected)
        return torch.where(free, 0, -1).long()


@register_chunker("fixed")
@dataclass(frozen=True)
class FixedSizeChunker:
    """Chunks of ``size`` consecutive tokens (by="tokens": original positions, so a chunk keeps
    its boundaries across rounds) or ``size`` consecutive clusterable slots (by="slots")."""

    size: int = 64
    by: str = "tokens"
    append_monotone = True  # appended raw tokens open or join the last chunk
    holes_ok = True  # sees slots through valid and slot order only (HoleTolerant: rounds in place)

    def __post_init__(self):
        check_int("size", self.size, 1)
        check_choice("by", self.by, ("tokens", "slots"))

    def __call__(self, state: KVState, protected: Tensor) -> Tensor:
        free = clusterable(state, protected)
        if self.by == "tokens":
            rel = state.positions - state.start()[:, None, None]  # [B, H, N]
            ids = torch.div(rel.clamp(min=0), self.size, rounding_mode="floor")
        else:
            ids = torch.div(free.long().cumsum(-1) - 1, self.size, rounding_mode="floor")
        return torch.where(free, ids, -1)


_TABLES: dict = {}  # (id(vocab), delimiters) -> (vocab, [V] bool table)
_MAX_TABLES = 16


def _delimiter_table(vocab, delimiters: tuple[str, ...]) -> Tensor:
    """[V] bool: token text contains any delimiter character.

    Keyed by the vocabulary's identity: hashing a 49k-string tuple costs milliseconds, and this is
    asked at every decode step. Each entry keeps a reference to its vocabulary, so the id cannot be
    reused by another object while the entry lives.
    """
    key = (id(vocab), delimiters)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is vocab:
        return hit[1]
    table = torch.tensor([any(d in text for d in delimiters) for text in vocab], dtype=torch.bool)
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.pop(next(iter(_TABLES)))  # oldest first
    _TABLES[key] = (vocab, table)
    return table


def delimiter_mask(state: KVState, delimiters: tuple[str, ...], delimiter_ids=None) -> Tensor:
    """[B, H, N] bool: slots whose representative token is a delimiter.

    Delimiter-ness comes from each token's decoded text (``state.vocab[id]``), so BPE tokens with
    fused delimiters (".\\n", " ,", "\\n\\n") count, for any tokenizer. ``delimiter_ids`` overrides
    the vocabulary lookup with an explicit id list.
    """
    require(state.token_ids is not None, "token_ids", None,
            "token ids [B, T] in the state: the delimiter chunker decides anchors from token text")
    ids = state.slot_token_ids()  # [B, H, N], -1 for padding
    if delimiter_ids is not None:
        table_ids = torch.as_tensor(list(delimiter_ids), dtype=torch.long, device=ids.device)
        return torch.isin(ids, table_ids) & (ids >= 0)
    require(state.vocab is not None, "vocab", None,
            "the decoded text of every token id in the state (or delimiter_ids in the chunker's params)")
    table = _delimiter_table(state.vocab, tuple(delimiters)).to(ids.device)
    inside = (ids >= 0) & (ids < table.numel())
    return table[ids.clamp(min=0, max=table.numel() - 1)] & inside


ANCHOR_MODES = ("keep", "merge")


@register_chunker("delimiter")
@dataclass(frozen=True)
class DelimiterChunker:
    """SemantiCache's semantic chunks: runs of tokens between delimiter tokens.

    anchors="keep" (the paper): delimiter tokens become anchors (chunk id -1: never merged); every
    run between two anchors is one chunk. Protected slots are left out but do not split a run.
    Anchors and one slot per chunk floor the cache (keep ~0.28 on English prose).
    anchors="merge": no anchors; a delimiter joins the run it ends, and adjacent delimiters
    (".\n\n", ", ") join one run, so a chunk is a clause with its punctuation and the floor is one
    slot per clause. The clusterer decides which members merge (GSC: the most similar keys
    first), delimiters included. SemantiCache uses it as its ``fallback_chunker``: only for heads
    whose budget the anchors put out of reach (and the pipeline joins runs of its clauses where
    one slot per clause is still too many: ``Pipeline.chunking``).
    delimiters:    substrings that make a token a delimiter (default . , ? ! newline tab)
    delimiter_ids: optional explicit token ids instead of the text lookup
    """

    delimiters: tuple[str, ...] = DEFAULT_DELIMITERS
    delimiter_ids: tuple[int, ...] | None = None
    anchors: str = "keep"
    append_monotone = True  # an appended token is an anchor, or opens or joins the last run

    def __post_init__(self):
        delims = self.delimiters
        require(isinstance(delims, (list, tuple)) and len(delims) > 0
                and all(isinstance(d, str) and d for d in delims),
                "delimiters", delims, "a non-empty list of non-empty strings")
        object.__setattr__(self, "delimiters", tuple(delims))
        if self.delimiter_ids is not None:
            object.__setattr__(self, "delimiter_ids", tuple(int(i) for i in self.delimiter_ids))
        check_choice("anchors", self.anchors, ANCHOR_MODES)

    def anchors_mask(self, state: KVState, protected: Tensor) -> Tensor:
        """[B, H, N] bool: delimiter slots that are not otherwise protected (none with anchors="merge")."""
        if self.anchors == "merge":
            return torch.zeros_like(state.valid)
        return delimiter_mask(state, self.delimiters, self.delimiter_ids) & clusterable(state, protected)

    def open_tail_start(self, state: KVState, frontier: Tensor, window_start: Tensor) -> Tensor | None:
        """[B] long: the position after the last delimiter in [frontier, window_start) (the run
        after it continues into the recent window, still open), else ``frontier``; None without
        token ids."""
        if state.token_ids is None:
            return None
        delim = delimiter_mask(state, self.delimiters, self.delimiter_ids)  # [B, H, N]
        pos = state.positions
        inside = delim & (pos >= frontier[:, None, None]) & (pos < window_start[:, None, None])
        last = torch.where(inside, pos, -1).amax(dim=(1, 2))  # [B]
        return torch.where(last >= 0, last + 1, frontier)

    def __call__(self, state: KVState, protected: Tensor) -> Tensor:
        delim = delimiter_mask(state, self.delimiters, self.delimiter_ids) & state.valid
        free = clusterable(state, protected)
        if self.anchors == "keep":
            ids = delim.long().cumsum(-1)  # a new chunk starts after every delimiter
            return torch.where(free & ~delim, ids, -1)
        # a run opens at a non-delimiter whose previous valid slot is a delimiter
        N = state.valid.shape[-1]
        slot = torch.arange(N, device=delim.device).expand_as(delim)
        last_valid = torch.where(state.valid, slot, -1).cummax(-1).values  # [B, H, N]
        before = torch.cat([torch.full_like(last_valid[..., :1], -1), last_valid[..., :-1]], dim=-1)
        prev_delim = delim.gather(-1, before.clamp(min=0)) & (before >= 0)
        opens = state.valid & ~delim & prev_delim
        return torch.where(free, opens.long().cumsum(-1), -1)
