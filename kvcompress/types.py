"""Core types: the state of one layer's KV cache as strategies see it.

Everything here is plain torch. A ``KVState`` is immutable by convention: strategies and
pipelines return a new state and never write into the tensors they were given, so a failed
compression can never leave a cache half-changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .validation import check_finite, check_same_device, require

NEG_INF = float("-inf")


@dataclass(frozen=True)
class KVState:
    """One layer's cache.

    keys:      [B, H, N, D]  cached keys (after RoPE), one row per slot
    values:    [B, H, N, D]
    log_sizes: [B, H, N]     float32; the per-slot additive attention bias, added to the scaled
                             logits (-inf = a padding slot). Proportional attention is the case
                             log_sizes == log(counts) (0 = an untouched token); a fitted merger
                             may set any finite bias
    counts:    [B, H, N]     float32 or None; how many original tokens a slot stands for (0 for
                             padding). None means exp(log_sizes); read it with token_counts()
    positions: [B, H, N]     long; index in the token stream of the slot's representative
                             token (the earliest member for GSC, the B token for CSM);
                             -1 for padding slots
    token_ids: [B, T]        long or None; the ids of all T tokens seen, indexed by positions
    protected: [B, H, N]     bool or None; slots that must never be merged or dropped
    seq_start: [B]           long or None; index of the first real (non left-padding) token
    num_tokens: int          T, tokens seen (slots may be fewer)
    vocab:     tuple of str  or None; decoded text of every token id (for text-aware chunkers)
    stats:     dict[str, Tensor]  per-slot statistics [B, H, N, ...] that every merger SUMS over
                             members and that the cache pads with zeros for appended tokens
                             (e.g. "attn_acc", the guard mark)
    extras:    dict          carried data, never classified by shape and never merged (e.g.
                             "queries" [B, Hq, W, D], "reference_queries", the decode frontier)
    """

    keys: Tensor
    values: Tensor
    log_sizes: Tensor
    positions: Tensor
    num_tokens: int
    token_ids: Tensor | None = None
    protected: Tensor | None = None
    seq_start: Tensor | None = None
    vocab: tuple[str, ...] | None = None
    extras: dict = field(default_factory=dict)
    counts: Tensor | None = None
    stats: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_raw(
        cls,
        keys: Tensor,
        values: Tensor,
        token_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        protected: Tensor | None = None,
        vocab=None,
    ) -> "KVState":
        """An uncompressed state: every slot is one token.

        keys, values:   [B, H, N, D]
        token_ids:      [B, N] or None
        attention_mask: [B, N] (1 = real token, 0 = left padding) or None
        """
        require(keys.dim() == 4, "keys", tuple(keys.shape), "a 4-d tensor [B, H, N, D]")
        B, H, N, _ = keys.shape
        log_sizes = torch.zeros(B, H, N, dtype=torch.float32, device=keys.device)
        positions = torch.arange(N, device=keys.device).expand(B, H, N).clone()
        seq_start = None
        if attention_mask is not None:
            require(
                tuple(attention_mask.shape) == (B, N),
                "attention_mask", tuple(attention_mask.shape), f"shape {(B, N)}",
            )
            real = attention_mask.to(torch.bool)  # [B, N]
            require(bool((real[:, 1:] >= real[:, :-1]).all()), "attention_mask", "a mask with holes or right padding",
                    "left padding only (zeros, then ones, in every row)")
            log_sizes = log_sizes.masked_fill(~real[:, None, :], NEG_INF)
            positions = positions.masked_fill(~real[:, None, :], -1)
            seq_start = (~real).long().cumprod(dim=1).sum(dim=1)  # leading pads per row
        state = cls(
            keys=keys, values=values, log_sizes=log_sizes, positions=positions,
            num_tokens=N, token_ids=token_ids, protected=protected, seq_start=seq_start,
            vocab=None if vocab is None else tuple(vocab),
        )
        state.validate()
        return state

    # ------------------------------------------------------------------ shape helpers
    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def valid(self) -> Tensor:
        """[B, H, N] bool: slots that hold tokens (not padding)."""
        return self.log_sizes > NEG_INF

    def token_counts(self) -> Tensor:
        """[B, H, N] float32: original tokens each slot stands for (0 for padding)."""
        if self.counts is None:
            return self.log_sizes.exp()
        return self.counts.masked_fill(~self.valid, 0.0)

    def sizes(self) -> Tensor:
        """[B, H, N] float32: tokens per slot (0 for padding); the same as ``token_counts()``."""
        return self.token_counts()

    def start(self) -> Tensor:
        """[B] long: first real token index per batch row."""
        if self.seq_start is None:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.keys.device)
        return self.seq_start

    def real_tokens(self) -> Tensor:
        """[B] long: tokens seen per batch row, left padding excluded."""
        return self.num_tokens - self.start()

    def slot_token_ids(self) -> Tensor:
        """[B, H, N] long: token id of each slot's representative (-1 for padding)."""
        require(self.token_ids is not None, "token_ids", None, "a [B, T] tensor of token ids")
        ids = self.token_ids.gather(1, self.positions.clamp(min=0).flatten(1))
        ids = ids.view_as(self.positions)
        return ids.masked_fill(self.positions < 0, -1)

    def bytes(self) -> int:
        """Bytes held by keys, values and log-sizes (padding included)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.log_sizes))

    def replace(self, **changes) -> "KVState":
        return replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the field when shapes, dtypes or devices disagree."""
        k, v = self.keys, self.values
        require(k.dim() == 4, "keys", tuple(k.shape), "a 4-d tensor [B, H, N, D]")
        require(tuple(v.shape) == tuple(k.shape), "values", tuple(v.shape), f"the keys' shape {tuple(k.shape)}")
        require(v.dtype == k.dtype, "values.dtype", v.dtype, f"the keys' dtype {k.dtype}")
        require(k.is_floating_point(), "keys.dtype", k.dtype, "a floating-point dtype")
        B, H, N, _ = k.shape
        require(
            tuple(self.log_sizes.shape) == (B, H, N),
            "log_sizes", tuple(self.log_sizes.shape), f"shape {(B, H, N)}",
        )
        require(self.log_sizes.dtype == torch.float32, "log_sizes.dtype", self.log_sizes.dtype, "torch.float32")
        require(
            tuple(self.positions.shape) == (B, H, N),
            "positions", tuple(self.positions.shape), f"shape {(B, H, N)}",
        )
        require(self.positions.dtype == torch.long, "positions.dtype", self.positions.dtype, "torch.int64")
        require(self.num_tokens >= 0, "num_tokens", self.num_tokens, "a count >= 0")
        tensors = {"keys": k, "values": v, "log_sizes": self.log_sizes, "positions": self.positions}
        if self.token_ids is not None:
            require(
                self.token_ids.dim() == 2 and self.token_ids.shape[0] == B
                and self.token_ids.shape[1] >= self.num_tokens,
                "token_ids", tuple(self.token_ids.shape), f"shape ({B}, >= {self.num_tokens})",
            )
            require(self.token_ids.dtype == torch.long, "token_ids.dtype", self.token_ids.dtype, "torch.int64")
            tensors["token_ids"] = self.token_ids
        if self.protected is not None:
            require(
                tuple(self.protected.shape) == (B, H, N) and self.protected.dtype == torch.bool,
                "protected", (tuple(self.protected.shape), self.protected.dtype), f"a bool tensor of shape {(B, H, N)}",
            )
            tensors["protected"] = self.protected
        if self.seq_start is not None:
            require(tuple(self.seq_start.shape) == (B,), "seq_start", tuple(self.seq_start.shape), f"shape ({B},)")
            tensors["seq_start"] = self.seq_start
        if self.counts is not None:
            require(tuple(self.counts.shape) == (B, H, N) and self.counts.dtype == torch.float32,
                    "counts", (tuple(self.counts.shape), self.counts.dtype),
                    f"a float32 tensor of shape {(B, H, N)} or None")
            tensors["counts"] = self.counts
        require(isinstance(self.stats, dict), "stats", type(self.stats).__name__, "a dict of per-slot tensors")
        for name, x in self.stats.items():
            require(isinstance(x, Tensor) and x.dim() >= 3 and tuple(x.shape[:3]) == (B, H, N),
                    f"stats[{name!r}]", tuple(getattr(x, "shape", ())) if isinstance(x, Tensor) else type(x).__name__,
                    f"a per-slot tensor of shape {(B, H, N)} + trailing dims")
            tensors[f"stats[{name!r}]"] = x
        check_same_device(tensors)
        check_finite("keys", k)
        check_finite("values", v)


@dataclass(frozen=True)
class CompressionReport:
    """What one compression of one layer did.

    slots_per_head: [B, H] long  slots holding tokens after compression
    tokens_per_row: [B]    long  real tokens covered
    target:         [B, H] long  the budget in slots
    num_slots:      int          slot count of the layer tensor (padding included)
    tau:            [B, H] float or None  the GSC threshold chosen per head
    rounds:         int          merge rounds run
    budget_met:     bool
    """

    slots_per_head: Tensor
    tokens_per_row: Tensor
    target: Tensor
    num_slots: int
    rounds: int
    budget_met: bool
    tau: Tensor | None = None
    layer_idx: int | None = None

    @property
    def padding_slots(self) -> int:
        """Slots of the layer tensor that hold nothing (summed over batch and heads)."""
        return int((self.num_slots - self.slots_per_head).sum())

    @property
    def keep_ratio(self) -> float:
        """Achieved slots / tokens, worst head."""
        ratio = self.slots_per_head.float() / self.tokens_per_row.clamp(min=1)[:, None].float()
        return float(ratio.max())

    def to_dict(self) -> dict:
        return {
            "layer_idx": self.layer_idx,
            "slots_per_head": self.slots_per_head.tolist(),
            "tokens_per_row": self.tokens_per_row.tolist(),
            "target": self.target.tolist(),
            "num_slots": self.num_slots,
            "padding_slots": self.padding_slots,
            "keep_ratio": self.keep_ratio,
            "rounds": self.rounds,
            "budget_met": self.budget_met,
            "tau": None if self.tau is None else self.tau.tolist(),
        }
