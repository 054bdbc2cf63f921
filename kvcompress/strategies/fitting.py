"""Fitting a merged slot to its cluster's attention over reference queries (pure tensor math).

For a cluster C, a query q and the slots' scaled logits s_i = q.k_i * scale + b_i (b = the slots'
attention bias, ``log_sizes``), the cluster's exact contribution to the attention row is a mass
m = sum_i exp(s_i) and a numerator m * o with o = softmax(s)_C . V_C. One merged slot (k, beta, v)
contributes exp(q.k * scale + beta) and that times v. Proportional attention (the mean key and
value, beta = log sum_i exp(b_i)) is exact only when the members' keys are equal: by Jensen's
inequality it under-states the mass for every query otherwise.

Per cluster, over the P reference queries of its KV head (R queries x G query heads):

* bias:  beta = the weighted mean over queries of log m_r - q_r.k * scale (the log-space least
  squares answer), the weight of query r being the cluster's share a_r = m_r / Z_r of that query's
  attention row raised to ``power`` (errors in a row's output scale with the share);
* value: with the fitted mass m'_r, the row output is exact for query r when
  v = rho_r o_r + (1 - rho_r) O_r (rho_r = m_r / m'_r, O_r the full row's output). The value is the
  weighted mean of those targets, query r weighing (m'_r / Z_r) ** power: the fitted slot's share
  of the row (before the row's own change; normalised over the queries). With power = 1 this is
  the first-order condition sum_r (m' v - sum_C e v - (m' - m) O_r) / Z_r = 0 and it separates:
  v = (sum_i a_i v_i + sum_r (m'_r - m_r) O_r / Z_r) / sum_r m'_r / Z_r, with a_i = sum_r p_ir,
  p_ir = e_ir / Z_r the attention slot i receives from query r. No [P, members] tensor is formed.
* key (optional, ``key="attention"``): the members' keys weighted by the attention they receive
  from the weighted queries (the average gradient of the cluster's log-mass, which is the least-
  squares slope for Gaussian-like queries), then beta refitted for it; with power = 1 the weight of
  member i is a_i (the queries' weights share_r cancel against its share of the cluster's mass).

With power = 1 the member sums count every query (one matrix-vector product gives a_i); a query
that does not see the cluster (see TINY) adds < TINY of a row to them. With another power the
members' weights are formed per (cluster, query) from the seen queries only.

After the per-cluster fit, ``refine_jointly`` moves the fitted slots of each head together
against the head's output error over the reference queries (a few soft-sign key steps, then one
ridge least-squares solve of the values): the per-cluster fit matches every cluster alone, and in
a row their errors add up.

Both fits shrink toward the proportional answer (mean value, beta = log sum exp(b)) with
``ridge`` pseudo-queries against the weights' effective number of queries, so a cluster no
reference query looks at keeps the proportional answer. Everything is computed in float32 on
flat [rows, P] tensors, the per-cluster sums as sparse CSR products over the members (index_add where
the power is not 1): no loop per slot or head.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from . import scratch as pool

NEG_INF = float("-inf")

# |log(m / m')| above which a query's value target is clipped: a linear logit cannot follow the
# cluster's log-mass that far, and extrapolating values from such queries only adds noise
MAX_LOG_RATIO = 4.0

# a cluster whose mass for a query is below TINY times the row's top term is unseen by that query:
# its share of the row is < 1e-30, so whatever the fit says there changes nothing
TINY = 1e-30


# slots per block of the blocked maximum over slots (``_max_over_slots``)
MAX_BLOCK = 128


def _max_over_slots(s: Tensor) -> Tensor:
    """s.amax(dim=2, keepdim=True) for s [B, H, N, P], exactly (a maximum does not depend on the
    order): over blocks of MAX_BLOCK slots first, then over the blocks. On CPU the one-step
    reduction over a long strided dimension ran ~3x slower at N = 8192, P = 192 (its running row
    of P maxima against rows far apart); the blocked one reads each block's rows together."""
    B, H, N, P = s.shape
    whole = N - N % MAX_BLOCK
    if whole < 4 * MAX_BLOCK:  # short: the plain reduction is as fast
        return s.amax(dim=2, keepdim=True)
    top = s[:, :, :whole].view(B, H, whole // MAX_BLOCK, MAX_BLOCK, P).amax(3).amax(2, keepdim=True)
    if whole < N:
        top = torch.maximum(top, s[:, :, whole:].amax(dim=2, keepdim=True))
    return top


def _buffer(name: str, shape: tuple, device: torch.device) -> Tensor:
    """A float32 scratch tensor for one of the fit's multi-MB temporaries (``scratch``: reused
    across the layers of a round instead of fresh pages each layer); valid until the next request
    of ``name``, so none outlives the call that took it."""
    return pool.scratch(f"fit.{name}", shape, torch.float32, device)


def _numerators(e: Tensor, values: Tensor) -> Tensor:
    """sum_i e_ir v_i [B, H, P, D] (contiguous) for e [B, H, N, P], values [B, H, N, D] float32, as
    (v^T e)^T: the product with the short operand transposed on the left ran ~1.4x faster than
    e^T v (e's long rows read strided) on CPU (8.0 vs 11.6 ms at N = 8192, P = 192, D = 64), with
    the same sums (bit-identical on the real 8k captures). Contiguous: later reductions over its
    last dimension sum in the order they did (a one-slot row's output is then its value exactly)."""
    return torch.matmul(values.transpose(-1, -2), e).transpose(-1, -2).contiguous()


def _dead_rows(bias: Tensor) -> Tensor | None:
    """The flat rows (into [B * H * K]) of slots whose bias is -inf (padding: their logits and weights
    are -inf / 0 for every query), None when there are none. bias: [B, H, K]."""
    dead = bias.reshape(-1).eq(NEG_INF)
    return dead.nonzero().squeeze(1) if bool(dead.any()) else None


def _exp_(s: Tensor, dead: Tensor | None) -> Tensor:
    """s.exp_() for s [B, H, K, P] (contiguous) whose rows ``dead`` (``_dead_rows``) are -inf, bit for bit:
    those rows are set to 0 around the exp instead of being exponentiated. On CPU torch's vectorised
    exp (Sleef) runs ~5-7x slower over lanes of -inf (0.47 vs 0.07 ms for [3, 700, 96] with a fifth of
    the rows -inf: the refined heads' padding rows), and exp(-inf) = 0 is what the fill writes."""
    if dead is None:
        return s.exp_()
    flat = s.view(-1, s.shape[-1])
    flat.index_fill_(0, dead, 0.0)
    return flat.exp_().index_fill_(0, dead, 0.0).view(s.shape)


@dataclass(frozen=True)
class FitResult:
    """Fitted slots, one row per output slot of the merge ([B, H, M, ...]).

    keys, values: [B, H, M, D] float32
    bias:         [B, H, M] float32
    n_eff:        [B, H, M] float32, effective number of reference queries behind the bias fit
    targets:      [B, H, P, D] float32, the uncompressed rows' outputs over the reference queries
    logits:       [B, H, M, P] float32, the fitted keys' scaled logits for the reference queries without
                  the bias (the joint steps start from them instead of multiplying again)
    """

    keys: Tensor
    values: Tensor
    bias: Tensor
    n_eff: Tensor
    targets: Tensor
    logits: Tensor


def _weights(share: Tensor, power: float, into: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slot query weights share ** power, normalised over the queries.

    share: [..., P] >= 0, exactly 0 for the queries that do not see the slot (weight 0)
    returns norm [..., P] (sums to 1, or 0 where no query sees the slot), n_eff = (sum w)^2 / sum w^2
    (the effective number of queries, 0 if none), both invariant to the scale of w, and 1 / sum(w)
    ([..., 1], 0 where no query sees the slot; with power 1, w = share); with ``into``, norm is
    the scratch tensor of that name (the caller's until its next use)
    """
    w = share
    if power != 1.0:  # relative to the largest share first: a high power would underflow small shares
        top = share.amax(-1, keepdim=True).clamp(min=TINY)
        w = torch.where(share > 0, (share / top).pow(power), 0.0)
    total = w.sum(-1, keepdim=True)
    # not clamped at TINY: a seen share is >= TINY / N, and the fitted share of the value step
    # (share / rho, rho up to e**MAX_LOG_RATIO) legitimately lies below TINY; float32's smallest
    # normal keeps the reciprocal finite
    inv = torch.where(total > 0, total.clamp(min=torch.finfo(total.dtype).tiny).reciprocal(), 0.0)
    if into is None:
        norm = w * inv  # in [0, 1]: its squares cannot underflow as w's might
        square = norm * norm
    else:
        norm = torch.mul(w, inv, out=_buffer(into, w.shape, w.device))
        square = torch.mul(norm, norm, out=_buffer("square", w.shape, w.device))
    n_eff = torch.where(total[..., 0] > 0, square.sum(-1).clamp(min=TINY).reciprocal(), 0.0)
    return norm, n_eff, inv


# a row of linear weights whose sum of squares is below this is rescaled before squaring
# (``_linear_weights``): above it the largest terms' squares are far from float32's underflow
# (>= 1e-26 / P), the ones that underflow add < P * 1e-38, and the squares' sum is exact to rounding
SQUARES_FLOOR = 1e-26


def _linear_weights(w: Tensor) -> tuple[Tensor, Tensor]:
    """_weights(w, 1.0)'s n_eff and 1 / sum(w) (bit for bit) without forming the normalised weights'
    squares: n_eff = (sum w)^2 / sum w^2 from one sum and one dot product per row (one or two
    passes over [..., P] fewer per call: the value step needs no normalised weights, the bias
    step forms them once). Rows whose squares would underflow
    (a cluster seen only faintly) take _weights' normalised squares. Equal to _weights' n_eff to
    float32 rounding (another order of the same operations).

    w: [..., P] >= 0; returns n_eff [...] (0 where sum w = 0) and inv [..., 1]
    """
    total = w.sum(-1, keepdim=True)
    inv = torch.where(total > 0, total.clamp(min=torch.finfo(total.dtype).tiny).reciprocal(), 0.0)
    squares = torch.linalg.vecdot(w, w)
    t = total[..., 0]
    n_eff = torch.where(t > 0, t * t / squares.clamp(min=SQUARES_FLOOR), 0.0)
    faint = (squares < SQUARES_FLOOR) & (t > 0)
    if bool(faint.any()):
        rows = faint.reshape(-1).nonzero().squeeze(1)
        norm = w.reshape(-1, w.shape[-1]).index_select(0, rows) * inv.reshape(-1, 1).index_select(0, rows)
        n_eff.view(-1).index_copy_(0, rows, norm.square().sum(-1).clamp(min=TINY).reciprocal())
    return n_eff, inv


def log_mass_of(mass: Tensor, top: Tensor, clamped: bool = False) -> Tensor:
    """log m of every cluster and query (mass relative to the row's top, top added back; finite
    where unseen: log TINY + top); ``clamped``: mass is a clamped copy already, taken in place."""
    return (mass if clamped else mass.clamp(min=TINY)).log_().add_(top)


def _shrink(n_eff: Tensor, ridge: float) -> Tensor:
    """Share of the prior in a ridge fit with ``ridge`` pseudo-queries: ridge / (n_eff + ridge)."""
    if ridge == 0:
        return (n_eff == 0).float()
    return ridge / (n_eff + ridge)


class _Members:
    """Per-cluster sums over the members as products with a sparse [clusters, slots] CSR matrix
    (one row per cluster, its members' columns in slot order): on CPU the sparse product ran
    ~2-3x faster than index_add_ of the [slots, E] rows (a scatter of single entries, the
    dropped slots' rows included, into a dummy row), and a weighted sum needs no weighted copy
    of the rows first. The members of a cluster are added in slot order, as index_add_ did.

    flat: [S] long, the cluster row of every slot, ``clusters`` = not a member (dropped, padding)
    """

    def __init__(self, flat: Tensor, clusters: int, slots: int):
        order = torch.argsort(flat, stable=True)  # slots by cluster row, the non-members last
        counts = torch.bincount(flat, minlength=clusters + 1)[:clusters]
        self.crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        self.cols = order[: int(self.crow[-1])]
        self.size = (clusters, slots)

    def sum(self, weight: Tensor | None, x: Tensor) -> Tensor:
        """[clusters, E] float32: sum_i weight_i x_i over each cluster's members (weight [S] or None
        = 1; x [S, E] float32)."""
        vals = x.new_ones(self.cols.shape[0]) if weight is None else weight.index_select(0, self.cols)
        with warnings.catch_warnings():
            # torch's notice that sparse CSR tensors are a beta feature (only the CSR x dense product is
            # used): silenced here, not in the caller's warning filters
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
            matrix = torch.sparse_csr_tensor(self.crow, self.cols, vals, size=self.size, check_invariants=False)
        return torch.sparse.mm(matrix, x)


def fit_clusters(
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    cluster: Tensor,
    queries: Tensor,
    prior_keys: Tensor,
    prior_values: Tensor,
    prior_bias: Tensor,
    *,
    scale: float,
    power: float = 1.0,
    ridge: float = 1.0,
    key: str = "mean",
    rest: RowPart | None = None,
) -> FitResult:
    """Fit one slot per cluster to the cluster's attention over reference queries.

    keys, values: [B, H, N, D] the slots before merging (any float dtype; math in float32)
    bias:         [B, H, N] float32, their attention bias (-inf = padding)
    cluster:      [B, H, N] long, output slot in [0, M) of each slot; -1 = dropped or padding
                  (it still counts in the attention rows, as in the cache being compressed)
    queries:      [B, H, P, D] reference queries grouped by KV head (rotated, unscaled)
    prior_*:      [B, H, M, D] / [B, H, M] the proportional answer (mean key and value, log sum of
                  sizes) the fit shrinks toward; prior_keys are the keys attention will use
                  with key="mean"
    scale:        logit scale (1/sqrt(D) for most models)
    rest:         the rows' part of slots of the cache NOT passed here (``row_part``: slots that stay
                  as they are, e.g. the merge's exact singletons): they count in every row's mass and
                  output, so the caller that has their part already passes only the other slots
                  (the clusters' members and the dropped ones) and the N-wide passes shrink
    """
    B, H, N, D = keys.shape
    M = prior_bias.shape[-1]
    P = queries.shape[2]
    dev = keys.device
    rows = B * H
    k32, v32 = keys.float(), values.float()

    # logits of every slot for every query, one row per slot: [B, H, N, P], the bias added after the
    # product (an inner dimension of D + 1, the bias riding along as one more key entry, ran the
    # product at half the speed of D on CPU); the queries transposed once, contiguous (a strided
    # right operand costs the matmul ~1.6x)
    # (the multi-MB temporaries below are scratch tensors: none outlives this call)
    q_t = _scaled_t(queries, scale)  # [B, H, D, P]
    s = torch.matmul(k32, q_t, out=_buffer("logits", (B, H, N, P), dev))
    if bool(bias.ne(0).any()):  # a fresh prefill's slots have none: adding 0 changes no logit
        s.add_(bias.float()[..., None])
    # one shift per query row (its top logit): e = exp(s - top) in [0, 1] serves the rows' mass,
    # their output and every cluster's mass; a cluster below TINY of the top is unseen by that query
    top = _max_over_slots(s)  # [B, H, 1, P]
    if rest is not None:
        top = torch.maximum(top, rest.top[:, :, None])
    top = torch.where(top > NEG_INF, top, 0.0)  # a row of padding only
    e = _exp_(s.sub_(top), _dead_rows(bias))  # [B, H, N, P], 0 for padding
    z = e.sum(2)  # [B, H, P], >= 1 (0: a row of padding only)
    if rest is not None:  # the other slots' terms against this top
        shift = (rest.top - top[:, :, 0]).exp_()  # [B, H, P], 0 where they are unseen
        z.add_(rest.mass * shift)
    e_flat = e.view(rows * N, P)

    # flat cluster row of every slot; dropped slots and padding go to one dummy row at the end
    flat = torch.where(cluster >= 0, cluster + torch.arange(rows, device=dev).view(B, H, 1) * M, rows * M).reshape(-1)
    members = _Members(flat, rows * M, rows * N)
    mass = members.sum(None, e_flat).view(B, H, M, P)
    # a query that does not see a cluster (mass below TINY of its row's top) weighs exactly 0
    # everywhere below, which is all the masking the fit needs
    torch.nn.functional.threshold_(mass, TINY, 0.0)
    zc = z.clamp(min=1.0)
    share = torch.div(mass, zc[:, :, None], out=_buffer("share", mass.shape, dev))  # m / Z, the cluster's share of the row (0 where unseen)

    def member_mean(coef: Tensor, x: Tensor) -> Tensor:
        """sum_i (sum_r coef[cl(i), r] p_ir) x_i per cluster, p_ir = e_ir / mass_r the member's
        share of its cluster's mass: coef [B, H, M, P] (0 where unseen), x [B, H, N, E]."""
        c = torch.cat([(coef / mass.clamp(min=TINY)).view(rows * M, P), coef.new_zeros(1, P)])  # last: dummy
        u = c.index_select(0, flat).mul_(e_flat).sum(-1, keepdim=True)  # [B*H*N, 1]
        out = x.new_zeros(rows * M + 1, x.shape[-1]).index_add_(0, flat, x.reshape(rows * N, -1) * u)
        return out[: rows * M].view(B, H, M, -1)

    separable = power == 1.0
    if separable:  # the weights are the shares (normalised: the bias step's weights, as _weights forms them)
        n_eff, inv = _linear_weights(share)  # [B, H, M], [B, H, M, 1]
        norm = torch.mul(share, inv, out=_buffer("norm", share.shape, dev))  # [B, H, M, P]
    else:
        norm, n_eff, inv = _weights(share, power, "norm")  # [B, H, M, P], [B, H, M], [B, H, M, 1]
    alpha = _shrink(n_eff, ridge)  # [B, H, M]
    # the full rows' outputs O_r [B, H, P, D] (a row of padding only: no output)
    row_out = _numerators(e, v32)
    if rest is not None:
        row_out.add_(rest.num * shift[..., None])
    row_out.div_(zc[..., None])
    if separable:
        # a_i: the attention slot i receives, summed over the queries; per cluster sum_i a_i k_i
        # and sum_i a_i v_i, one scatter each ([B*H*M, D] sums: keys then values; sum_i a_i = sum_r share_r)
        a = torch.einsum("bhnp,bhp->bhn", e, zc.reciprocal()).reshape(-1)  # [B*H*N]
        sum_v = members.sum(a, v32.reshape(rows * N, D)).view(B, H, M, D)
        sum_k = members.sum(a, k32.reshape(rows * N, D)).view(B, H, M, D) if key != "mean" else None
    slot_keys = prior_keys.float()
    if key != "mean":
        fitted = sum_k.mul_(inv) if separable else member_mean(norm, k32)
        # attention sees the key in the cache's dtype: fit the bias to that key
        slot_keys = torch.lerp(fitted, slot_keys, alpha[..., None]).to(keys.dtype).float()

    # log m - q.k: the bias each query asks for (finite where unseen, where its weight is 0)
    logits = torch.matmul(slot_keys, q_t)  # [B, H, M, P], kept for the joint steps
    y = log_mass_of(torch.clamp(mass, min=TINY, out=_buffer("y", mass.shape, dev)), top, clamped=True).sub_(logits)
    beta_fit = torch.linalg.vecdot(norm, y)
    beta = torch.lerp(beta_fit, prior_bias.float(), alpha)

    # values: targets rho o_r + (1 - rho) O_r (rho = m / m' = exp(y - beta), clipped), query r
    # weighing (m'_r / Z_r) ** power = (share / rho) ** power
    rho = y.sub_(beta[..., None]).clamp_(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp_()
    fitted_share = torch.div(share, rho, out=_buffer("fitted_share", share.shape, dev))  # m' / Z (0 where unseen)
    if separable:
        n_eff2, inv2 = _linear_weights(fitted_share)
    else:
        norm2, n_eff2, inv2 = _weights(fitted_share, power, "norm2")
    alpha_v = _shrink(n_eff2, ridge)
    if separable:
        # norm2 rho = share inv2 and norm2 (1 - rho) = (m' - m) / Z inv2:
        # v = (sum_i a_i v_i + sum_r (m'_r - m_r) / Z_r O_r) / sum_r m'_r / Z_r
        value_fit = torch.matmul(fitted_share.sub_(share), row_out).add_(sum_v).mul_(inv2)
    else:
        value_fit = member_mean(norm2 * rho, v32).add_(torch.matmul(norm2 * (1.0 - rho), row_out))
    slot_values = torch.lerp(value_fit, prior_values.float(), alpha_v[..., None])
    return FitResult(keys=slot_keys, values=slot_values, bias=beta, n_eff=n_eff, targets=row_out, logits=logits)


# the soft sign's knee, as a share of a slot's largest key-gradient entry: entries well above it
# move a full step (the sign of the gradient, as Adam's first steps do), entries below it move in
# proportion (continuous in the inputs; a slot no query sees does not move)
SOFT_SIGN_KNEE = 0.1

# a head whose slots already reproduce its rows' outputs to this relative error takes a
# proportionally smaller key step: near an exact fit the gradient is rounding noise, whose sign
# must not move keys a full step
SETTLED = 0.01

# the joint value solve's ridge, relative to the mean attention a query pays the fitted slots
# (squared): how far the values may move from the per-cluster fit to serve the queries together
VALUE_RIDGE = 1.0


@dataclass(frozen=True)
class RowPart:
    """The slots that stay put, summed per query row: their top logit, mass and numerator
    (relative to that top), so that the moving slots' steps recompute only their own logits.

    top:  [B, H, P] float32 (-inf where none of these slots is seen); mass: [B, H, P]; num: [B, H, P, D]
    """

    top: Tensor
    mass: Tensor
    num: Tensor


def _scaled_t(queries: Tensor, scale: float) -> Tensor:
    """[B, H, P, D] -> [B, H, D, P] float32, scaled and contiguous (the matmuls' right operand)."""
    return (queries.float() * scale).transpose(-1, -2).contiguous()


def row_part(keys: Tensor, values: Tensor, bias: Tensor, queries: Tensor, scale: float) -> RowPart:
    """keys, values: [B, H, M, D], bias: [B, H, M] (-inf: not part of it), queries: [B, H, P, D]."""
    B, H, M, _ = keys.shape
    s = torch.matmul(keys.float(), _scaled_t(queries, scale),
                     out=_buffer("logits", (B, H, M, queries.shape[2]), keys.device)).add_(bias.float()[..., None])
    top = s.amax(dim=2)  # -inf where none of the slots is seen (mass and num 0 then)
    e = _exp_(s.sub_(torch.where(top > NEG_INF, top, 0.0)[:, :, None]), _dead_rows(bias))  # [B, H, M, P]
    return RowPart(top=top, mass=e.sum(2), num=_numerators(e, values.float()))


def _logits(keys: Tensor, bias: Tensor, q_t: Tensor, logits: Tensor | None) -> Tensor:
    """[B, H, K, P] scaled logits plus bias, a fresh tensor: from ``logits`` (the keys' bias-free
    logits, already multiplied) when given, else keys @ q_t."""
    if logits is None:
        return torch.matmul(keys, q_t).add_(bias[..., None])
    return torch.add(logits, bias[..., None])


def _attention(keys: Tensor, values: Tensor, bias: Tensor, q_t: Tensor, rest: RowPart,
               logits: Tensor | None = None, dead: Tensor | None = None):
    """The moving slots' attention a [B, H, K, P] and the rows' outputs [B, H, P, D], the rows
    being these slots and ``rest`` (a query whose row is all padding: zeros, not NaN);
    q_t: [B, H, D, P] the queries scaled and transposed (``_scaled_t``); logits: keys @ q_t when
    already known; dead: ``_dead_rows(bias)``."""
    s = _logits(keys, bias, q_t, logits)
    top = torch.maximum(s.amax(dim=2), rest.top)  # [B, H, P]
    top = torch.where(top > NEG_INF, top, 0.0)
    e = _exp_(s.sub_(top[:, :, None]), dead)
    shift = (rest.top - top).exp_()  # the rest's terms against the new top
    inv = (e.sum(2) + rest.mass * shift).clamp(min=TINY).reciprocal_()  # [B, H, P]
    out = _numerators(e, values).add_(rest.num * shift[..., None]).mul_(inv[..., None])
    return e.mul_(inv[:, :, None]), out


def split_moving(keys: Tensor, values: Tensor, bias: Tensor, rest: RowPart, queries: Tensor, *, scale: float,
                 share: float, logits: Tensor | None = None) -> tuple[Tensor, RowPart]:
    """The ``share`` of each head's fitted slots that the key steps move: those the reference queries
    attend to most under the closed form (their summed attention over the queries; the other slots
    carry little of any row, and moving them buys little KL for the same work), and the rows' part
    of the others folded into ``rest`` (they stay put: their terms are computed once).

    keys, values: [B, H, K, D] float32 fitted slots; bias: [B, H, K] (-inf: an empty row)
    logits:       [B, H, K, P] the keys' scaled logits without the bias, when known (``FitResult.logits``)
    returns the moving slots' indices [B, H, T] (T = ceil(share * K), in no particular order) and the
    rows' part of ``rest`` and of the slots that stay, one RowPart
    """
    K = keys.shape[2]
    T = max(1, min(K, math.ceil(share * K)))
    if logits is None:
        s = _logits(keys, bias, _scaled_t(queries, scale), None)  # [B, H, K, P]
    else:  # in the scratch: the slots' shares die here
        s = torch.add(logits, bias[..., None], out=_buffer("logits", logits.shape, logits.device))
    top = torch.maximum(s.amax(dim=2), rest.top)
    top = torch.where(top > NEG_INF, top, 0.0)  # [B, H, P]
    e = _exp_(s.sub_(top[:, :, None]), _dead_rows(bias))
    shift = (rest.top - top).exp_()
    rest_mass = rest.mass * shift
    inv = (e.sum(2) + rest_mass).clamp(min=TINY).reciprocal_()  # [B, H, P]
    attention = torch.matmul(e, inv[..., None])[..., 0]  # [B, H, K]: sum_r a_jr
    moving = attention.topk(T, dim=-1, sorted=False).indices  # [B, H, T]
    # the slots that stay: the moving ones' rows zeroed (whole rows of the flat view, not a
    # scatter of single entries through an expanded index)
    B, H = moving.shape[:2]
    rows = (torch.arange(B * H, device=moving.device).view(B, H, 1) * K + moving).reshape(-1)
    e.view(B * H * K, -1).index_fill_(0, rows, 0.0)
    part = RowPart(top=top, mass=rest_mass.add_(e.sum(2)),
                   num=_numerators(e, values).add_(rest.num * shift[..., None]))
    return moving, part


def refine_jointly(
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    rest: RowPart,
    queries: Tensor,
    targets: Tensor,
    *,
    scale: float,
    steps: int,
    step: float,
    dtype: torch.dtype,
    logits: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Move the fitted slots' keys and values so that the head's slots TOGETHER reproduce the
    uncompressed rows' outputs over the reference queries (the per-cluster fit matches each cluster
    alone; errors of neighbouring clusters add up in a row).

    keys, values: [B, H, K, D] float32, the fitted slots (from fit_clusters)
    bias:         [B, H, K] float32, their bias, unchanged (-inf: an empty row, which never moves)
    rest:         the other slots of the rows (singletons, identical members), which stay put
    queries:      [B, H, P, D] reference queries; targets: [B, H, P, D] the uncompressed rows' outputs
    steps, step:  soft-sign gradient steps on the keys of the rows' squared output error, ``step``
                  in logit units (a full step moves a query's logit by at most ``step``: scaled by
                  the head's mean |q|_1; smaller for a head already within SETTLED of its
                  targets; a step that does not lower the head's error is undone and the next is
                  half as long); then the values by one ridge least squares over the queries
                  (P x P per head: the fewest-change correction, toward the per-cluster fit)
    dtype:        the cache's dtype: every step sees the keys as attention will
    logits:       [B, H, K, P] the given keys' scaled logits without the bias, when known (the first
                  step's attention then needs no product)
    returns the keys and values, [B, H, K, D] float32; the error over the reference queries is
    never above the per-cluster fit's
    """
    q = queries.float()
    q_t = _scaled_t(q, scale)
    lr = step / (q.abs().sum(-1).mean(-1) * scale).clamp(min=TINY)  # [B, H]
    scale_t = targets.square().sum((-2, -1)).clamp(min=TINY)  # [B, H]
    best_err = torch.full_like(lr, float("inf"))
    dead = _dead_rows(bias)  # the padding rows, the same every step
    for t in range(steps + 1):
        a, out = _attention(keys, values, bias, q_t, rest, logits if t == 0 else None, dead)  # [B, H, K, P], [B, H, P, D]
        g = out - targets
        err = g.square().sum((-2, -1))  # [B, H]
        better = err <= best_err
        best_err = torch.where(better, err, best_err)
        if t == 0 or bool(better.all()):  # every head took the step: no per-head selection to copy
            best_keys, best_a, best_out, improved = keys, a, out, True
        else:
            lr = lr * torch.where(better, 1.0, 0.5)
            improved = bool(better.any())
            if improved:
                b4 = better[..., None, None]
                best_keys, best_a, best_out = (torch.where(b4, keys, best_keys), torch.where(b4, a, best_a),
                                               torch.where(b4, out, best_out))
        if t == steps:
            break
        # d err / d logit of slot j for query r: a_jr (v_j - out_r) . g_r; the step goes from the
        # best keys, along their gradient (a head whose step was undone keeps its gradient)
        if improved:
            c = torch.matmul(values, g.transpose(-1, -2)).sub_((out * g).sum(-1)[:, :, None]).mul_(a)
            here = torch.matmul(c, q)  # [B, H, K, D], the logit scale folded into lr's sign step
            grad = here if t == 0 or bool(better.all()) else torch.where(better[..., None, None], here, grad)
        size = grad.abs()  # |grad|, then |grad| + knee in place: one pass and tensor fewer, the same numbers
        knee = size.amax(-1, keepdim=True).mul_(SOFT_SIGN_KNEE).clamp(min=TINY)
        # a head within SETTLED of its targets moves proportionally less: rounding noise's sign
        # must not move a key a full step
        gate = (best_err / scale_t).sqrt_().div_(SETTLED).clamp_(max=1.0)
        # best_keys - lr gate grad / (|grad| + knee), in that order of operations, in one fresh tensor
        move = torch.mul(grad, (lr * gate)[..., None, None]).div_(size.add_(knee))
        keys = torch.sub(best_keys, move, out=move).to(dtype).float()
    a = best_a
    res = targets - best_out
    gram = torch.matmul(a.transpose(-1, -2), a)  # [B, H, P, P]
    ridge = gram.diagonal(dim1=-2, dim2=-1).mean(-1) * VALUE_RIDGE  # [B, H]
    seen = ridge > TINY
    eye = torch.eye(gram.shape[-1], device=gram.device)
    x = torch.linalg.solve(gram + torch.where(seen, ridge, 1.0)[..., None, None] * eye, res)
    return best_keys, values + torch.matmul(a, x * seen[..., None, None])
