"""Greedy Seed-based Clustering (SemantiCache), per KV head, vectorised over batch, heads and chunks.

Inside each chunk, walk the slots in order; the first unassigned slot becomes a seed and absorbs
every LATER unassigned slot of its chunk whose key cosine similarity with the SEED's key is > tau.
One pass; clusters never cross chunks.

How it is computed: a slot j is absorbed by the first seed i < j with cos(i, j) > tau, and it is a
seed itself when no earlier seed absorbs it. So the walk only has to find the seed set; the member
-> seed map then follows without a loop. The walk runs over the position inside a chunk (at most
the bucket length, never over tokens), for all chunks, heads and thresholds at once, and keeps
each chunk's unassigned members as a bitset: a step is a few ops on [S, C] words. The bitsets of
"members a seed would absorb" come from each cosine's slot among the C sorted thresholds (counted by
comparisons), its member's bit added into that slot's word, and prefix sums over the slots; the
seeds per threshold are counted by a popcount of their bitsets.

Budget: with ``tau=None`` a per-head threshold is searched so that each head ends with at most
its target slots; the highest feasible tau found (fewest merges) wins. The search evaluates
``search_width`` thresholds at once per pass and narrows the bracket
``search_passes`` times; the plan reuses the seeds found for the chosen tau.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..protocols import ClusterPlan
from ..registry import register_clusterer
from ..types import KVState
from ..validation import check_int, check_range
from .scratch import scratch
from .segments import Bucket, SegmentLayout, build_segments

TAU_NO_MERGE = 1.0001  # above any cosine (rounding included): nothing merges
TAU_MERGE_ALL = -1.0001  # below any cosine: a seed absorbs its whole chunk
_EXCLUDED = -3.0  # similarity entry that is not a later real member: below every threshold
ADJ_LIMIT = 1 << 26  # thresholded-similarity booleans [rows, C, S, L] materialised at once

_WORDS = ((8, torch.int8), (16, torch.int16), (32, torch.int32), (64, torch.int64))


def _word_layout(L: int) -> tuple[int, torch.dtype, int]:
    """Bitset layout for L members: (bits per word, word dtype, words per bitset)."""
    for width, dtype in _WORDS:
        if L <= width:
            return width, dtype, 1
    return 64, torch.int64, (L + 63) // 64


def _bit_weights(width: int, dtype: torch.dtype, device) -> Tensor:
    """[width] value of each bit. The top bit weighs -2**(width-1): bits are disjoint, so sums of
    them have no carries and no partial sum overflows, in any order."""
    weights = [1 << k for k in range(width - 1)] + [-(1 << (width - 1))]
    return torch.tensor(weights, dtype=dtype, device=device)


def _pack(bits: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """[..., L] bool -> [..., W] bitsets (member j is bit j % width of word j // width).

    Eight booleans become one byte with eight shifts and ORs on 1/8 of the data; the bytes,
    read as little-endian words, are the bitsets."""
    L = bits.shape[-1]
    W = (L + width - 1) // width
    if sys.byteorder != "little":
        weights = _bit_weights(width, dtype, bits.device)
        padded = torch.cat([bits, bits.new_zeros(*bits.shape[:-1], W * width - L)], -1)
        return (padded.reshape(*bits.shape[:-1], W, width) * weights).sum(-1, dtype=dtype)
    if W * width != L:
        bits = torch.cat([bits, bits.new_zeros(*bits.shape[:-1], W * width - L)], -1)
    by_byte = bits.contiguous().view(torch.uint8).reshape(*bits.shape[:-1], -1, 8)
    packed = by_byte[..., 0].clone()
    for k in range(1, 8):
        packed.bitwise_or_(by_byte[..., k].bitwise_left_shift(k))
    return packed.view(dtype)  # [..., W]


def _unpack(words: Tensor, width: int, L: int) -> Tensor:
    """[..., W] bitsets -> [..., L] bool."""
    shifts = torch.arange(min(width, L), dtype=words.dtype, device=words.device)
    bits = (words[..., None] >> shifts) & 1  # [..., W, min(width, L)]
    return bits.reshape(*words.shape[:-1], -1)[..., :L].bool()


class BucketSimilarity:
    """Cosines between the members of every segment of a bucket, by blocks of seed rows.

    keys: [S, L, D] unit-norm keys of the segments' members
    mask: [S, L] bool real members
    rows(i0, i1) -> [i1 - i0, S, L]: cos(member i, member j) for i in [i0, i1), clamped to [-1, 1]
    (rounding can push the cosine of identical keys above 1, and "cos > 1" must never hold), and
    _EXCLUDED where j is not a real member later than i. Cached whole when S * L * L <= dense_limit.

    pool: None (the keys, cosines and paired rows are this object's own tensors) or this bucket's
    index in a call that drops its objects before it returns (``GreedySeedClustering``): they live
    in pooled buffers (``scratch``) of that index, reused by the next layer's call.
    """

    def __init__(self, kn: Tensor, bucket: Bucket, num_slots: int, dense_limit: int, pool: int | None = None):
        self.mask = bucket.mask
        S, L = self.mask.shape
        self._pool = pool
        index = bucket.flat_index(num_slots).view(-1)
        self.keys = torch.index_select(kn, 0, index, out=self._own("keys", (S * L, kn.shape[1]), kn.dtype)).view(S, L, -1)
        self.words = _word_layout(L)
        self.dense = self._compute(0, L) if S * L * L <= dense_limit else None
        self.row_block = L if self.dense is not None else max(1, dense_limit // max(1, S * L))
        self._paired = None  # [L/2, S, L] rows i and L-1-i in one (see _absorbed_dense)
        self._bit = self._col = self._word_row = None
        self._cols_for = -1

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> Tensor:
        """An uninitialised scratch tensor, the same storage for every call with this name, in this
        bucket, the other buckets and the next layers (``scratch``: pooled per thread; its content
        is valid until the next call that asks for it)."""
        return scratch("gsc." + name, shape, dtype, self.mask.device)

    def _own(self, name: str, shape: tuple, dtype: torch.dtype) -> Tensor:
        """A tensor this object keeps: pooled under its bucket index, or fresh."""
        if self._pool is None:
            return torch.empty(shape, dtype=dtype, device=self.mask.device)
        return scratch(f"gsc.{name}.{self._pool}", shape, dtype, self.mask.device)

    def _compute(self, i0: int, i1: int) -> Tensor:
        whole = i0 == 0 and i1 == self.mask.shape[1]  # the dense block, kept: in this object's storage
        out = self._own("dense", (self.keys.shape[0], i1 - i0, self.mask.shape[1]),
                        self.keys.dtype) if whole else None
        sims = torch.matmul(self.keys[:, i0:i1], self.keys.transpose(1, 2), out=out)  # [S, b, L]
        # [b, S, L] as a strided view, not a copy: every consumer is elementwise (or copies
        # what it keeps into its own layout), and the copy cost as much as the product
        sims = sims.clamp_(-1.0, 1.0).transpose(0, 1)  # [b, S, L]
        L = self.mask.shape[1]
        i = torch.arange(i0, i1, device=sims.device)[:, None, None]
        j = torch.arange(L, device=sims.device)[None, None, :]
        # two broadcast masks ([b, 1, L] not later, [1, S, L] padding) instead of one [b, S, L]
        # mask and its negation: the same entries excluded, two fewer passes over the block
        return sims.masked_fill_(j <= i, _EXCLUDED).masked_fill_(~self.mask[None], _EXCLUDED)

    def rows(self, i0: int, i1: int) -> Tensor:
        return self.dense[i0:i1] if self.dense is not None else self._compute(i0, i1)

    def block(self, per_row: int) -> int:
        """Seed rows per block when each row costs ``per_row`` booleans."""
        return max(1, min(self.row_block, ADJ_LIMIT // max(1, per_row)))

    def spared(self, tau: Tensor) -> list[tuple[int, Tensor]]:
        """Blocks (i0, words [b, S, C, W]): per seed row i = i0 + r, the bitset of the members
        that i does NOT absorb, for C thresholds tau [S, C].

        With the dense cosines at hand, each cosine is placed among its segment's thresholds once
        (a binary search over C sorted values, not a comparison per threshold), its member's bit
        is added to the word of that slot, and a suffix sum over the C + 1 slots gives the union
        of the members above each threshold: O(S L^2 log C) per call, no sort of the cosines."""
        width, dtype, W = self.words
        L = self.mask.shape[1]
        S, C = tau.shape
        if self.dense is not None and L % 2 == 0:  # (buckets are powers of two, L >= 2)
            return [(0, self._absorbed_dense(tau).bitwise_not_())]  # absorbed -> spared
        step = self.block(C * S * L)
        thr = tau[None, :, :, None]  # [1, S, C, 1]
        return [(i0, ~_pack(self.rows(i0, min(i0 + step, L))[:, :, None] > thr, width, dtype))
                for i0 in range(0, L - 1, step)]

    def _absorbed_dense(self, tau: Tensor) -> Tensor:
        """[L, S, C, W] bitsets of the members each row absorbs (cosine > tau), from the dense cosines.

        Seed row i only holds the L - 1 - i members after it, so rows i and L - 1 - i share one
        row of L entries (row L-1-i's member j stored at k = L-1-j < i; every other entry is
        _EXCLUDED in both, so the larger value is the right one): half the searches. A cosine
        below or at every threshold lands in slot 0, which no threshold counts."""
        width, dtype, W = self.words
        L = self.mask.shape[1]
        S, C = tau.shape
        device = tau.device
        P = L // 2
        if self._paired is None:
            # written contiguous: the search passes read it C times each
            paired = self._own("paired", (P, S, L), self.dense.dtype)
            self._paired = torch.maximum(self.dense[:P], self.dense[P:].flip((0, 2)), out=paired)  # [P, S, L]
            k = torch.arange(L, device=device)
            lower = k < k[:P, None]  # [P, L]: entry (i, k) belongs to row L-1-i
            member = torch.where(lower, L - 1 - k, k)  # whose bit entry (i, k) is
            self._bit = _bit_weights(width, dtype, device)[member % width][:, None, :]  # [P, 1, L]
            self._word_row = (lower.long(), torch.div(member, width, rounding_mode="floor"))
        if self._cols_for != C:  # column of entry (i, k) in a row's [2, C + 1, W] words, slot 0
            lower, word = self._word_row
            self._col = (lower * (C + 1) * W + word)[:, None, :]  # [P, 1, L]
            self._cols_for = C
        sorted_tau, perm = tau.sort(dim=1, stable=True)  # [S, C]
        out = self.buffer("absorbed", (L, S, C, W), dtype)  # the caller is done with it before the next pass
        step = max(1, ADJ_LIMIT // max(1, S * L * 8))  # bounds the [b, S, L] slot indices
        for p0 in range(0, P, step):
            p1 = min(p0 + step, P)
            vals = self._paired[p0:p1]  # [b, S, L]
            b = p1 - p0
            slot = _count_below(vals, sorted_tau, self.buffer)  # [b, S, L]
            index = self.buffer("index", (b, S, L), torch.long).copy_(slot)  # (a mixed-dtype add copies to a temporary)
            if W > 1:
                index.mul_(W)
            index.add_(self._col[p0:p1])
            words = self.buffer("words", (b, S, 2 * (C + 1) * W), dtype).zero_()
            words.scatter_add_(2, index, self._bit[p0:p1].expand(b, S, L))  # disjoint bits: the sum is the union
            # members above threshold c: slots c + 1 .. C, the total less the prefix up to c (the
            # sums wrap like the words' bits: exact in two's complement)
            prefix = torch.cumsum(words.view(b, S, 2, C + 1, W), 3, dtype=dtype,
                                  out=self.buffer("prefix", (b, S, 2, C + 1, W), dtype))
            torch.sub(prefix[:, :, 0, C:], prefix[:, :, 0, :C], out=out[p0:p1])  # rows p0..p1: in place
            above = torch.sub(prefix[:, :, 1, C:], prefix[:, :, 1, :C],
                              out=self.buffer("above", (b, S, C, W), dtype))  # [b, S, C, W] rows L-1-p
            out[L - p1:L - p0] = above.flip(0)
        if not bool((perm == torch.arange(C, device=device)).all()):
            inverse = perm.argsort(1)  # [S, C]: sorted position of each original threshold
            out = out.gather(2, inverse[None, :, :, None].expand(L, S, C, W))
        return out


_COMPARE_LIMIT = 64  # thresholds per segment up to which comparisons beat a binary search


def _count_below(vals: Tensor, sorted_tau: Tensor, buffer=None) -> Tensor:
    """[b, S, L] integer: how many of segment s's thresholds lie strictly below each value (the
    slot ``searchsorted`` finds). vals: [b, S, L]; sorted_tau: [S, C] ascending; buffer:
    ``BucketSimilarity.buffer`` (scratch tensors reused between calls) or None.

    One comparison per threshold is faster on CPU than a binary search per value. After a few
    search passes the thresholds bracket a narrow interval and most cosines lie below or above
    all of them: then only those in between are searched."""
    b, S, L = vals.shape
    C = sorted_tau.shape[1]
    if C > _COMPARE_LIMIT:
        return torch.searchsorted(sorted_tau[None].expand(b, S, C).contiguous(), vals)
    if buffer is None:
        def buffer(name, shape, dtype):
            return torch.empty(shape, dtype=dtype, device=vals.device)
    thr = sorted_tau.t().contiguous()[:, None, :, None]  # [C, 1, S, 1]
    above_lo = torch.gt(vals, thr[0], out=buffer("above_lo", (b, S, L), torch.bool))
    if C == 1:
        return above_lo.view(torch.uint8)
    above_hi = torch.gt(vals, thr[C - 1], out=buffer("above_hi", (b, S, L), torch.bool))  # implies above_lo
    slot = buffer("slot", (b, S, L), torch.uint8)
    between = torch.bitwise_xor(above_lo, above_hi, out=slot.view(torch.bool))
    if int(torch.count_nonzero(between)) * 8 < between.numel():  # (a bool sum converts to int64 first)
        pick = between.view(-1).nonzero().squeeze(1)
        seg = torch.div(pick, L, rounding_mode="floor").remainder_(S)
        got = _count_below_picked(vals.reshape(-1).index_select(0, pick), seg, sorted_tau)
        torch.mul(above_hi.view(torch.uint8), C, out=slot)
        return slot.view(-1).index_copy_(0, pick, got.to(torch.uint8)).view(b, S, L)
    torch.add(above_lo.view(torch.uint8), above_hi.view(torch.uint8), out=slot)  # bools viewed as 0/1 bytes
    hit = above_lo  # reused as the comparison buffer
    for k in range(1, C - 1):
        slot.add_(torch.gt(vals, thr[k], out=hit).view(torch.uint8))
    return slot


def _ordered_bits(x: Tensor) -> Tensor:
    """float32 -> int32 in the same order: ``a < b`` exactly when ``key(a) < key(b)``, equal values
    equal keys (not NaN). Positive floats order as their bits; a negative one's magnitude bits are
    flipped so that larger magnitudes come first; -0.0 becomes +0.0 first (``x + 0.0``)."""
    bits = (x + 0.0).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _count_below_picked(vals: Tensor, seg: Tensor, sorted_tau: Tensor) -> Tensor:
    """[n] long: how many of segment seg[i]'s thresholds lie strictly below vals[i].

    One search of a single sorted table instead of a row of thresholds gathered per value: each
    threshold and value becomes the int64 ``segment * 2**32 + order key`` (exact: no float sum
    rounds), so segment s's entries fill one contiguous run of the table, and the position of a
    value's key in it less s * C is its slot, ties at thresholds included (``searchsorted``'s
    left side: thresholds equal to the value are not below it). NaN thresholds or other dtypes:
    the per-value search."""
    S, C = sorted_tau.shape
    if vals.dtype != torch.float32 or sorted_tau.dtype != torch.float32 or bool(torch.isnan(sorted_tau).any()):
        return torch.searchsorted(sorted_tau.index_select(0, seg), vals[:, None]).squeeze(1)
    base = torch.arange(S, device=seg.device)[:, None] * (1 << 32) + (1 << 31)  # [S, 1]
    table = (_ordered_bits(sorted_tau).long() + base).reshape(-1)  # [S * C] ascending
    keys = _ordered_bits(vals).long().add_(seg * (1 << 32) + (1 << 31))
    return torch.searchsorted(table, keys).sub_(seg * C)


def bucket_seeds(sims: BucketSimilarity, tau: Tensor) -> Tensor:
    """The GSC walk for C thresholds: [C, S, L] bool, True at seeds (``seed_words`` unpacked)."""
    S, L = sims.mask.shape
    width, _, _ = sims.words
    return _unpack(seed_words(sims, tau), width, L).transpose(0, 1)


_POPCOUNT = torch.tensor([bin(v).count("1") for v in range(256)], dtype=torch.uint8)


def popcount(words: Tensor) -> Tensor:
    """[..., W] integer bitsets -> [...] long: bits set (a byte table, any word width)."""
    table = _POPCOUNT.to(words.device)
    as_bytes = words.contiguous().view(torch.uint8).reshape(*words.shape[:-1], -1)
    return table[as_bytes.long()].sum(-1, dtype=torch.long)


def seed_words(sims: BucketSimilarity, tau: Tensor) -> Tensor:
    """The GSC walk for C thresholds: [S, C, W] bitsets of the seeds (real members only).

    tau: [C, S] threshold per segment. A slot stays unassigned until an earlier seed absorbs it,
    and seeds are never absorbed, so the slots still unassigned after the walk are the seeds. The
    walk keeps each segment's unassigned members as a bitset, so a step costs a handful of ops on
    [S, C] words whatever the segment length.
    """
    S, L = sims.mask.shape
    C = tau.shape[0]
    width, dtype, W = sims.words
    # [S, C, W]: segment-major like the similarity rows, so no step needs a transposed copy
    unassigned = _pack(sims.mask, width, dtype)[:, None].expand(S, C, W).clone()  # padding: assigned
    words = [unassigned[:, :, w:w + 1] for w in range(W)]  # views: they follow the in-place updates
    shifts = torch.arange(width, dtype=dtype, device=tau.device).unbind()  # 0-d: no per-step casts
    one = torch.ones((), dtype=dtype, device=tau.device)
    for i0, spared in sims.spared(tau.t()):
        rows = spared.unbind(0)
        for r in range(min(len(rows), L - 1 - i0)):  # the last member has nobody after it
            w, bit = divmod(i0 + r, width)
            # [S, C, 1]: 0 where member i is (still) a seed, all ones where it is not
            not_seed = torch.bitwise_right_shift(words[w], shifts[bit]).bitwise_and_(one).sub_(one)
            unassigned.bitwise_and_(torch.bitwise_or(rows[r], not_seed))
    return unassigned  # padding bits start clear and are only ever cleared


def _rank_dtype(n: int) -> torch.dtype:
    """The narrowest integer dtype holding 0..n."""
    return torch.uint8 if n <= 255 else torch.int16 if n <= 32767 else torch.int32


def bucket_parents(sims: BucketSimilarity, seeds: Tensor, tau: Tensor) -> Tensor:
    """[S, L] long: local index of each member's seed (the first seed i < j with cos > tau; itself
    for seeds and padding). seeds: [S, L] bool; tau: [S]."""
    S, L = seeds.shape
    seed_of = torch.arange(L, device=seeds.device).expand(S, L).clone()
    found = torch.zeros(S, L, dtype=torch.bool, device=seeds.device)
    seed_rows = seeds.t()  # [L, S]
    # a row that is no seed absorbs nothing: its threshold is +inf (no cosine is above it), so
    # one comparison gives "seed i absorbs j" without a second pass for the seed mask
    thr = torch.where(seed_rows, tau[None, :], float("inf"))[:, :, None]  # [L, S, 1]
    step = sims.block(S * L)
    for i0 in range(0, L - 1, step):
        i1 = min(i0 + step, L - 1)
        b = i1 - i0
        hit = torch.gt(sims.rows(i0, i1), thr[i0:i1], out=sims.buffer("parents.hit", (b, S, L), torch.bool))
        # the first hit row weighs most: one max over rows (vectorised along the members) gives
        # both whether any seed of the block absorbs j and which one comes first (an argmax
        # over the outer dim is several times slower)
        rank = torch.arange(b, 0, -1, dtype=_rank_dtype(b), device=seeds.device)[:, None, None]
        weighted = torch.mul(hit, rank, out=sims.buffer("parents.rank", (b, S, L), rank.dtype))
        top = weighted.amax(0)  # [S, L]: b - (first hit row), 0 where none
        first = (i1 - top.long()).clamp_(max=L - 1)  # first seed row of this block absorbing j
        new = (top > 0) & ~found
        seed_of = torch.where(new, first, seed_of)
        found |= new
    return seed_of


def gsc_run(
    kn: Tensor,
    layout: SegmentLayout,
    tau: Tensor,
    outside: Tensor,
    want_plan: bool = False,
    dense_limit: int = 1 << 26,
    cache: dict | None = None,
):
    """Run GSC for C thresholds per row at once.

    kn:      [R * N, D] unit-norm keys
    tau:     [C, R] thresholds
    outside: [R] long, valid slots not in any bucket (each is its own cluster)
    returns  counts [C, R] (clusters + outside slots) and, if want_plan, per bucket the local
             seed index of every member [C, S, L] (else None per bucket)
    """
    C, R = tau.shape
    counts = outside[None, :].expand(C, R).clone()
    plans = []
    for b_idx, bucket in enumerate(layout.buckets):
        key = ("sim", b_idx)
        if cache is not None and key in cache:
            sims = cache[key]
        else:
            sims = BucketSimilarity(kn, bucket, layout.num_slots, dense_limit)
            if cache is not None:
                cache[key] = sims
        t = tau[:, bucket.rows]  # [C, S]
        seeds = bucket_seeds(sims, t)
        counts.index_add_(1, bucket.rows, seeds.sum(-1))
        plans.append(torch.stack([bucket_parents(sims, seeds[c], t[c]) for c in range(C)])
                     if want_plan else None)
    return counts, plans


@register_clusterer("gsc")
@dataclass(frozen=True)
class GreedySeedClustering:
    """SemantiCache's GSC on key cosine similarity.

    tau:           fixed threshold in [-1, 1]; None searches a per-head tau that meets the budget
    search_width:  thresholds tried per search pass
    search_passes: bracket refinements (resolution ~ 2 / (search_width + 1) ** search_passes)
    dense_limit:   largest S * L * L similarity block precomputed per bucket (else row by row)
    """

    tau: float | None = None
    search_width: int = 15
    search_passes: int = 3
    dense_limit: int = 1 << 26
    decode_scope = "tail"  # at decode time only slots not yet compressed are clustered

    def __post_init__(self):
        if self.tau is not None:
            check_range("tau", self.tau, -1.0, 1.0)
        check_int("search_width", self.search_width, 1)
        check_int("search_passes", self.search_passes, 1)
        check_int("dense_limit", self.dense_limit, 1)

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        B, H, N, D = state.keys.shape
        R = B * H
        valid = state.valid.reshape(R, N)
        # (F.normalize's numbers, into a pooled buffer: only the buckets' gathers read it)
        keys = state.keys.float()
        kn = F.normalize(keys, dim=-1, out=scratch("gsc.kn", tuple(keys.shape), keys.dtype, keys.device)).reshape(R * N, D)
        layout = build_segments(torch.where(valid, chunk_ids.reshape(R, N), -1), min_length=2)
        sims = [BucketSimilarity(kn, b, N, self.dense_limit, pool=i) for i, b in enumerate(layout.buckets)]
        valid_count = valid.sum(1)  # [R]
        target_rows = target.reshape(R).to(kn.device)

        if self.tau is not None:
            tau = torch.full((R,), float(self.tau), device=kn.device)
            seeds = [bucket_seeds(s, tau[None, b.rows])[0] for s, b in zip(sims, layout.buckets)]
        else:
            tau, seeds = self._search(layout, sims, valid_count, target_rows)

        slot = torch.arange(N, device=kn.device)
        parent = torch.where(valid, slot, -1).reshape(R * N).clone()
        for bucket, s, seed_mask in zip(layout.buckets, sims, seeds):
            seed_of = bucket_parents(s, seed_mask, tau[bucket.rows])  # [S, L]
            seed_slot = bucket.slots.gather(1, seed_of)
            flat = bucket.flat_index(N)
            parent[flat[bucket.mask]] = seed_slot[bucket.mask]
        return ClusterPlan(parent.view(B, H, N), done=True, tau=tau.view(B, H))

    @staticmethod
    def _counts(layout: SegmentLayout, sims: list, outside: Tensor, cands: Tensor) -> tuple[Tensor, list]:
        """Slots per row [C', R] at each candidate tau [C', R], and each bucket's seed bitsets [S, C', W]."""
        counts = outside[None, :].expand(cands.shape[0], -1).clone()
        all_words = [seed_words(s, cands[:, b.rows]) for s, b in zip(sims, layout.buckets)]  # [S, C', W]
        for bucket, words in zip(layout.buckets, all_words):
            counts.index_add_(1, bucket.rows, popcount(words).t())
        return counts, all_words

    def _search(self, layout: SegmentLayout, sims: list, valid_count: Tensor, target_rows: Tensor):
        """Highest feasible tau per row [R] and the seeds [S, L] of every bucket at that tau."""
        R = target_rows.numel()
        device = target_rows.device
        fits = valid_count <= target_rows  # rows that fit without merging keep everything
        no_merge = torch.full((R,), TAU_NO_MERGE, device=device)
        if not layout.buckets or bool(fits.all()):
            return no_merge, [b.mask for b in layout.buckets]
        # the bracket's low end is always feasible or TAU_MERGE_ALL (the fewest reachable slots:
        # each segment collapses into its first member); its seeds are kept, not recomputed
        lo = torch.full((R,), TAU_MERGE_ALL, device=device)
        hi = no_merge.clone()
        # seeds kept as bitsets [S, W] (counted by popcount, unpacked once at the end): the low
        # end's are each segment's first member
        lo_words = []
        for b, sim in zip(layout.buckets, sims):
            width, dtype, W = sim.words
            first = torch.zeros(b.mask.shape[0], W, dtype=dtype, device=device)
            lo_words.append(first.index_fill_(1, torch.zeros(1, dtype=torch.long, device=device), 1))
        in_buckets = torch.zeros(R, dtype=torch.long, device=device)
        for bucket in layout.buckets:
            in_buckets.index_add_(0, bucket.rows, bucket.mask.sum(1))
        outside = valid_count - in_buckets
        C = self.search_width
        frac = torch.arange(1, C + 1, device=device, dtype=torch.float32)[:, None] / (C + 1)  # [C, 1]
        order = torch.arange(C, device=device)[:, None]
        for p in range(self.search_passes):
            cands = lo[None] + (hi - lo)[None] * frac  # [C, R], increasing
            # only the highest feasible candidate matters, and a candidate's count does not depend
            # on the others: the first pass (bracket [-1, 1]; cosines of keys inside a chunk are
            # mostly positive, so the answer is high) tries its top third first and the rest only
            # when some row found none feasible there. Same counts, same choice, fewer comparisons.
            top = C // 3 if p == 0 and C >= 3 else C
            counts, all_words = self._counts(layout, sims, outside, cands[C - top:])
            if top < C and not bool((counts <= target_rows[None]).any(0).all()):
                low_counts, low_words = self._counts(layout, sims, outside, cands[:C - top])
                counts = torch.cat([low_counts, counts])
                all_words = [torch.cat([lw, w], 1) for lw, w in zip(low_words, all_words)]
            # highest feasible candidate per row (counts need not be monotone in tau), -1 if none
            first = C - counts.shape[0]  # candidates below it were not counted (a higher one is feasible)
            idx = torch.where(counts <= target_rows[None], order[first:], -1).max(0).values  # [R]
            better = idx >= 0
            pick = idx.clamp(min=0)
            hi = torch.where(idx + 1 < C, cands.gather(0, (idx + 1).clamp(max=C - 1)[None])[0], hi)
            lo = torch.where(better, cands.gather(0, pick[None])[0], lo)
            lo_words = [torch.where(better[b.rows, None],
                                    words[torch.arange(len(b.rows), device=device), (pick[b.rows] - first).clamp(min=0)],
                                    prev) for b, words, prev in zip(layout.buckets, all_words, lo_words)]
        chosen = [torch.where(fits[b.rows, None], b.mask, _unpack(words, s.words[0], b.length) & b.mask)
                  for b, s, words in zip(layout.buckets, sims, lo_words)]
        return torch.where(fits, no_merge, lo), chosen
