"""The fitted merger's math as it was at main 687849f (session 9), kept verbatim as the slow reference
the current ``kvcompress.strategies.fitting`` / ``FittedMerger.refit`` must match (bit for bit where the
tests say so, else within the tolerance they state). ``refit(merger, state, parent, merged)`` is the
session-9 ``FittedMerger.refit`` with ``merger``'s parameters."""


from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompress.strategies.fitted import _HOW, WINDOW_QUERIES, query_sources  # constants and the query spec: unchanged
from kvcompress.strategies.mergers import is_identity_plan
from kvcompress.types import KVState
from kvcompress.validation import require

NEG_INF = float("-inf")

# |log(m / m')| above which a query's value target is clipped: a linear logit cannot follow the
# cluster's log-mass that far, and extrapolating values from such queries only adds noise
MAX_LOG_RATIO = 4.0

# a cluster whose mass for a query is below TINY times the row's top term is unseen by that query:
# its share of the row is < 1e-30, so whatever the fit says there changes nothing
TINY = 1e-30


@dataclass(frozen=True)
class FitResult:
    """Fitted slots, one row per output slot of the merge ([B, H, M, ...]).

    keys, values: [B, H, M, D] float32
    bias:         [B, H, M] float32
    n_eff:        [B, H, M] float32, effective number of reference queries behind the bias fit
    targets:      [B, H, P, D] float32, the uncompressed rows' outputs over the reference queries
    """

    keys: Tensor
    values: Tensor
    bias: Tensor
    n_eff: Tensor
    targets: Tensor


def _weights(share: Tensor, power: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slot query weights share ** power, normalised over the queries.

    share: [..., P] >= 0, exactly 0 for the queries that do not see the slot (weight 0)
    returns norm [..., P] (sums to 1, or 0 where no query sees the slot), n_eff = (sum w)^2 / sum w^2
    (the effective number of queries, 0 if none), both invariant to the scale of w, and 1 / sum(w)
    ([..., 1], 0 where no query sees the slot; with power 1, w = share)
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
    norm = w * inv  # in [0, 1]: its squares cannot underflow as w's might
    n_eff = torch.where(total[..., 0] > 0, torch.linalg.vecdot(norm, norm).clamp(min=TINY).reciprocal(), 0.0)
    return norm, n_eff, inv


def log_mass_of(mass: Tensor, top: Tensor) -> Tensor:
    """log m of every cluster and query (mass relative to the row's top, top added back; finite
    where unseen: log TINY + top)."""
    return mass.clamp(min=TINY).log_().add_(top)


def _shrink(n_eff: Tensor, ridge: float) -> Tensor:
    """Share of the prior in a ridge fit with ``ridge`` pseudo-queries: ridge / (n_eff + ridge)."""
    if ridge == 0:
        return (n_eff == 0).float()
    return ridge / (n_eff + ridge)


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
    """
    B, H, N, D = keys.shape
    M = prior_bias.shape[-1]
    P = queries.shape[2]
    dev = keys.device
    rows = B * H
    k32, v32 = keys.float(), values.float()

    # logits of every slot for every query, one row per slot: [B, H, N, P]; the bias rides along
    # as one more key dimension against a query entry of 1 (one pass over the [N, P] logits)
    # (the queries transposed once, contiguous: a strided right operand costs the matmul ~1.6x)
    k_aug = torch.cat([k32, bias.float()[..., None]], dim=-1)
    q_aug_t = torch.cat([queries.float() * scale, queries.new_ones(B, H, P, 1, dtype=torch.float32)],
                        dim=-1).transpose(-1, -2).contiguous()  # [B, H, D + 1, P]
    s = torch.matmul(k_aug, q_aug_t)
    # one shift per query row (its top logit): e = exp(s - top) in [0, 1] serves the rows' mass,
    # their output and every cluster's mass; a cluster below TINY of the top is unseen by that query
    top = s.amax(dim=2, keepdim=True)  # [B, H, 1, P]
    top = torch.where(top > NEG_INF, top, 0.0)  # a row of padding only
    e = s.sub_(top).exp_()  # [B, H, N, P], 0 for padding
    z = e.sum(2)  # [B, H, P], >= 1 (0: a row of padding only)
    e_flat = e.view(rows * N, P)

    # flat cluster row of every slot; dropped slots and padding go to one dummy row at the end
    flat = torch.where(cluster >= 0, cluster + torch.arange(rows, device=dev).view(B, H, 1) * M, rows * M).reshape(-1)
    mass = e.new_zeros(rows * M + 1, P).index_add_(0, flat, e_flat)[: rows * M].view(B, H, M, P)
    # a query that does not see a cluster (mass below TINY of its row's top) weighs exactly 0
    # everywhere below, which is all the masking the fit needs
    torch.nn.functional.threshold_(mass, TINY, 0.0)
    zc = z.clamp(min=1.0)
    share = mass / zc[:, :, None]  # m / Z, the cluster's share of the row (0 where unseen)

    def member_mean(coef: Tensor, x: Tensor) -> Tensor:
        """sum_i (sum_r coef[cl(i), r] p_ir) x_i per cluster, p_ir = e_ir / mass_r the member's
        share of its cluster's mass: coef [B, H, M, P] (0 where unseen), x [B, H, N, E]."""
        c = torch.cat([(coef / mass.clamp(min=TINY)).view(rows * M, P), coef.new_zeros(1, P)])  # last: dummy
        u = c.index_select(0, flat).mul_(e_flat).sum(-1, keepdim=True)  # [B*H*N, 1]
        out = x.new_zeros(rows * M + 1, x.shape[-1]).index_add_(0, flat, x.reshape(rows * N, -1) * u)
        return out[: rows * M].view(B, H, M, -1)

    norm, n_eff, inv = _weights(share, power)  # [B, H, M, P], [B, H, M], [B, H, M, 1]
    alpha = _shrink(n_eff, ridge)  # [B, H, M]
    # the full rows' outputs O_r [B, H, P, D] (a row of padding only: no output)
    row_out = torch.matmul(e.transpose(-1, -2), v32).div_(zc[..., None])
    separable = power == 1.0
    if separable:
        # a_i: the attention slot i receives, summed over the queries; per cluster sum_i a_i k_i
        # and sum_i a_i v_i, one scatter each ([B*H*M, D] sums: keys then values; sum_i a_i = sum_r share_r)
        a = torch.einsum("bhnp,bhp->bhn", e, zc.reciprocal())[..., None]  # [B, H, N, 1]
        parts = (k32, v32) if key != "mean" else (v32,)
        sums = torch.cat([e.new_zeros(rows * M + 1, D).index_add_(0, flat, (x * a).view(rows * N, D))[: rows * M]
                          for x in parts], dim=-1).view(B, H, M, -1)
    slot_keys = prior_keys.float()
    if key != "mean":
        fitted = sums[..., :D] * inv if separable else member_mean(norm, k32)
        # attention sees the key in the cache's dtype: fit the bias to that key
        slot_keys = torch.lerp(fitted, slot_keys, alpha[..., None]).to(keys.dtype).float()

    # log m - q.k: the bias each query asks for (finite where unseen, where its weight is 0)
    y = log_mass_of(mass, top).sub_(torch.matmul(slot_keys, q_aug_t[..., :D, :]))
    beta_fit = torch.linalg.vecdot(norm, y)
    beta = torch.lerp(beta_fit, prior_bias.float(), alpha)

    # values: targets rho o_r + (1 - rho) O_r (rho = m / m' = exp(y - beta), clipped), query r
    # weighing (m'_r / Z_r) ** power = (share / rho) ** power
    rho = y.sub_(beta[..., None]).clamp_(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp_()
    fitted_share = share / rho  # m' / Z (0 where unseen)
    norm2, n_eff2, inv2 = _weights(fitted_share, power)
    alpha_v = _shrink(n_eff2, ridge)
    if separable:
        # norm2 rho = share inv2 and norm2 (1 - rho) = (m' - m) / Z inv2:
        # v = (sum_i a_i v_i + sum_r (m'_r - m_r) / Z_r O_r) / sum_r m'_r / Z_r
        own = sums[..., D:] if key != "mean" else sums
        value_fit = torch.matmul(fitted_share.sub_(share), row_out).add_(own).mul_(inv2)
    else:
        value_fit = member_mean(norm2 * rho, v32).add_(torch.matmul(norm2 * (1.0 - rho), row_out))
    slot_values = torch.lerp(value_fit, prior_values.float(), alpha_v[..., None])
    return FitResult(keys=slot_keys, values=slot_values, bias=beta, n_eff=n_eff, targets=row_out)


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
    s = torch.matmul(keys.float(), _scaled_t(queries, scale)).add_(bias.float()[..., None])
    top = s.amax(dim=2)  # -inf where none of the slots is seen (mass and num 0 then)
    e = s.sub_(torch.where(top > NEG_INF, top, 0.0)[:, :, None]).exp_()  # [B, H, M, P]
    return RowPart(top=top, mass=e.sum(2), num=torch.matmul(e.transpose(-1, -2), values.float()))


def _attention(keys: Tensor, values: Tensor, bias: Tensor, q_t: Tensor, rest: RowPart):
    """The moving slots' attention a [B, H, K, P] and the rows' outputs [B, H, P, D], the rows
    being these slots and ``rest`` (a query whose row is all padding: zeros, not NaN);
    q_t: [B, H, D, P] the queries scaled and transposed (``_scaled_t``)."""
    s = torch.matmul(keys, q_t).add_(bias[..., None])
    top = torch.maximum(s.amax(dim=2), rest.top)  # [B, H, P]
    top = torch.where(top > NEG_INF, top, 0.0)
    e = s.sub_(top[:, :, None]).exp_()
    shift = (rest.top - top).exp_()  # the rest's terms against the new top
    inv = (e.sum(2) + rest.mass * shift).clamp(min=TINY).reciprocal_()  # [B, H, P]
    out = torch.matmul(e.transpose(-1, -2), values).add_(rest.num * shift[..., None]).mul_(inv[..., None])
    return e.mul_(inv[:, :, None]), out


def split_moving(keys: Tensor, values: Tensor, bias: Tensor, rest: RowPart, queries: Tensor, *, scale: float,
                 share: float) -> tuple[Tensor, RowPart]:
    """The ``share`` of each head's fitted slots that the key steps move: those the reference queries
    attend to most under the closed form (their summed attention over the queries; the other slots
    carry little of any row, and moving them buys little KL for the same work), and the rows' part
    of the others folded into ``rest`` (they stay put: their terms are computed once).

    keys, values: [B, H, K, D] float32 fitted slots; bias: [B, H, K] (-inf: an empty row)
    returns the moving slots' indices [B, H, T] (T = ceil(share * K), in no particular order) and the
    rows' part of ``rest`` and of the slots that stay, one RowPart
    """
    K = keys.shape[2]
    T = max(1, min(K, math.ceil(share * K)))
    s = torch.matmul(keys, _scaled_t(queries, scale)).add_(bias[..., None])  # [B, H, K, P]
    top = torch.maximum(s.amax(dim=2), rest.top)
    top = torch.where(top > NEG_INF, top, 0.0)  # [B, H, P]
    e = s.sub_(top[:, :, None]).exp_()
    shift = (rest.top - top).exp_()
    rest_mass = rest.mass * shift
    inv = (e.sum(2) + rest_mass).clamp(min=TINY).reciprocal_()  # [B, H, P]
    attention = torch.matmul(e, inv[..., None])[..., 0]  # [B, H, K]: sum_r a_jr
    moving = attention.topk(T, dim=-1, sorted=False).indices  # [B, H, T]
    e.scatter_(2, moving[..., None].expand(-1, -1, -1, e.shape[-1]), 0.0)  # the slots that stay
    part = RowPart(top=top, mass=rest_mass.add_(e.sum(2)),
                   num=torch.matmul(e.transpose(-1, -2), values).add_(rest.num * shift[..., None]))
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
    returns the keys and values, [B, H, K, D] float32; the error over the reference queries is
    never above the per-cluster fit's
    """
    q = queries.float()
    q_t = _scaled_t(q, scale)
    lr = step / (q.abs().sum(-1).mean(-1) * scale).clamp(min=TINY)  # [B, H]
    scale_t = targets.square().sum((-2, -1)).clamp(min=TINY)  # [B, H]
    best_err = torch.full_like(lr, float("inf"))
    for t in range(steps + 1):
        a, out = _attention(keys, values, bias, q_t, rest)  # [B, H, K, P], [B, H, P, D]
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
        knee = grad.abs().amax(-1, keepdim=True).mul_(SOFT_SIGN_KNEE).clamp(min=TINY)
        # a head within SETTLED of its targets moves proportionally less: rounding noise's sign
        # must not move a key a full step
        gate = (best_err / scale_t).sqrt_().div_(SETTLED).clamp_(max=1.0)
        keys = (best_keys - (lr * gate)[..., None, None] * grad / (grad.abs() + knee)).to(dtype).float()
    a = best_a
    res = targets - best_out
    gram = torch.matmul(a.transpose(-1, -2), a)  # [B, H, P, P]
    ridge = gram.diagonal(dim1=-2, dim2=-1).mean(-1) * VALUE_RIDGE  # [B, H]
    seen = ridge > TINY
    eye = torch.eye(gram.shape[-1], device=gram.device)
    x = torch.linalg.solve(gram + torch.where(seen, ridge, 1.0)[..., None, None] * eye, res)
    return best_keys, values + torch.matmul(a, x * seen[..., None, None])


# ---- FittedMerger.refit and its helpers (kvcompress/strategies/fitted.py at 687849f), ``self`` = the merger


def cluster_index(parent: Tensor) -> Tensor:
    """[B, H, N] long: the output slot of each slot under ``parent`` (as apply_merge_plan orders
    them: representatives in slot order), -1 for dropped slots."""
    slot = torch.arange(parent.shape[-1], device=parent.device)
    out_index = (parent == slot).long().cumsum(-1) - 1
    return torch.where(parent >= 0, out_index.gather(-1, parent.clamp(min=0)), -1)


def grouped_queries(state: KVState, names: tuple[str, ...], who: str = "fitted merger",
                    limit: int | None = None, stride: int = 1) -> Tensor:
    """The reference queries of ``names`` in extras, concatenated and grouped by KV head:
    [B, Hq, R, D] -> [B, H, G * R, D] (query head h * G + g belongs to KV head h)."""
    B, H, _, D = state.keys.shape
    parts = []
    for name in names:
        q = state.extras.get(name)
        require(q is not None, f"{who}: state.extras[{name!r}]", None,
                f"the reference queries [B, Hq, R, D] of the layer: {_HOW[name]}")
        require(isinstance(q, Tensor) and q.dim() == 4 and q.shape[0] == B and q.shape[3] == D
                and q.shape[1] % H == 0 and q.shape[2] >= 1, f"{who}: state.extras[{name!r}]",
                tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__,
                f"a tensor [B={B}, Hq (a multiple of {H}), R >= 1, D={D}]")
        if name == WINDOW_QUERIES and limit is not None:
            q = q[:, :, -limit:]  # other strategies may have asked for a longer window
        if stride > 1:  # every stride-th query, the last one included
            q = q[:, :, (q.shape[2] - 1) % stride::stride]
        parts.append(q.reshape(B, H, -1, D))
    return torch.cat(parts, dim=2).to(state.keys.device)


def refit(self, state: KVState, parent: Tensor, merged: KVState) -> KVState:
    """Refit the merged slots of ``merged`` to their members in ``state``.

    state:  the slots before merging (keys/values [B, H, N, D], the reference queries in extras)
    parent: [B, H, N] long, the plan taking ``state`` to ``merged`` (several rounds composed)
    merged: the proportional merge of ``state`` under ``parent`` (M slots): its bookkeeping
            (positions, protection, counts, stats) is kept; only fitted slots' key, value and
            bias change
    """
    if is_identity_plan(state, parent):
        return merged
    cluster = cluster_index(parent)
    B, H, M = merged.log_sizes.shape
    require(int(cluster.max()) < M if cluster.numel() else True, "merged", f"{M} slots",
            "the merge of state under parent (one slot per representative)")
    N, D = state.num_slots, state.head_dim
    rows = B * H
    dev = parent.device
    member = cluster >= 0
    counts = merged.token_counts()  # the rounds' token counts, whatever the bias becomes
    # a cluster whose members' keys are all bitwise equal to its representative's is exact under
    # proportional attention (and the mean merger returns that key): keep it bit for bit. A
    # cluster with a differing member has two members or more, so "differs" is the whole test.
    # (a cache's [B, N, H, D]-strided views copied once: every pass below reads them whole)
    k_in, v_in = state.keys.contiguous(), state.values.contiguous()
    differs = member & _differs_from(k_in, parent.clamp(min=0))
    fit = torch.zeros(rows * (M + 1), device=dev).index_add_(
        0, _flat_index(torch.where(member, cluster, M), M + 1), differs.reshape(-1).float()
    ).view(B, H, M + 1)[:, :, :M] > 0  # [B, H, M]
    if not bool(fit.any()):
        return merged.replace(counts=counts)
    queries = grouped_queries(state, query_sources(self.queries), limit=self.reference_queries,
                              stride=self.query_stride)
    scale = self.scale if self.scale is not None else 1.0 / math.sqrt(state.head_dim)
    # fit only the K clusters per head that need it, renumbered 0..K-1 (heads with fewer have
    # empty rows: no members, never read); index copies in and out, no [B, H, M, D] gathers
    fit_rows, at, K, rank = _compaction(fit)

    def compact(x: Tensor, shape: tuple) -> Tensor:
        return _compact(x, fit_rows, at, rows * K).view(shape)

    sub = torch.where(fit, rank, -1)
    prior_k, prior_v = compact(merged.keys, (B, H, K, D)), compact(merged.values, (B, H, K, D))
    prior_b = compact(merged.log_sizes, (B, H, K))
    # members of clusters not fitted still count in the attention rows (cluster -1)
    sub_cluster = torch.where(member, sub.gather(-1, cluster.clamp(min=0)), -1)  # [B, H, N]
    def put(x: Tensor, fitted: Tensor, dtype: torch.dtype) -> Tensor:  # the fitted rows into a copy of x
        out = x.reshape(rows * M, -1).to(dtype, copy=True)
        out.index_copy_(0, fit_rows, fitted.reshape(-1, out.shape[1]).index_select(0, at).to(dtype))
        return out.view(x.shape)

    res = fit_clusters(
        k_in, v_in, state.log_sizes, sub_cluster, queries, prior_k, prior_v, prior_b,
        scale=scale, power=self.power, ridge=self.ridge, key=self.key,
    )
    if self.refine:
        # the slots that are not fitted stay put: their part of the rows is computed once
        # (compacted like the fitted ones: the rows' work is over the slots that stay, not all M)
        stay_rows, stay_at, S, _ = _compaction(~fit)
        S = max(S, 1)

        def stay(x: Tensor, fill: float = 0.0) -> Tensor:
            return _compact(x, stay_rows, stay_at, rows * S, fill).view(B, H, S, *x.shape[3:])

        rest = row_part(stay(merged.keys), stay(merged.values), stay(merged.log_sizes.float(), NEG_INF),
                        queries, scale)
    keys, values = res.keys, res.values
    if self.refine:
        live = torch.zeros(rows * K, dtype=torch.bool, device=dev).index_fill_(0, at, True).view(B, H, K)
        bias = res.bias.masked_fill(~live, NEG_INF)
        if self.refine_share < 1.0:
            moving, rest = split_moving(keys, values, bias, rest, queries, scale=scale, share=self.refine_share)
            take = moving[..., None].expand(-1, -1, -1, D)
            moved_k, moved_v = refine_jointly(keys.gather(2, take), values.gather(2, take), bias.gather(2, moving),
                                              rest, queries, res.targets, scale=scale, steps=self.refine,
                                              step=self.refine_step, dtype=merged.keys.dtype)
            keys, values = keys.scatter(2, take, moved_k), values.scatter(2, take, moved_v)
        else:
            keys, values = refine_jointly(keys, values, bias, rest, queries, res.targets, scale=scale,
                                          steps=self.refine, step=self.refine_step, dtype=merged.keys.dtype)
    # only the fitted rows change: everything else stays the merge's, bit for bit
    return merged.replace(keys=put(merged.keys, keys, merged.keys.dtype),
                          values=put(merged.values, values, merged.values.dtype),
                          log_sizes=put(merged.log_sizes, res.bias, merged.log_sizes.dtype), counts=counts)


def _compaction(mask: Tensor) -> tuple[Tensor, Tensor, int, Tensor]:
    """The True slots of ``mask`` [B, H, M] renumbered 0..K-1 per head (K = the most in a head):
    their flat rows in [B * H * M], their flat rows in [B * H * K], K, and each slot's rank."""
    M = mask.shape[-1]
    rows = mask.reshape(-1).nonzero().squeeze(1)
    rank = mask.long().cumsum(-1) - 1
    K = int(rank[..., -1].max()) + 1 if mask.numel() else 0
    at = (rows // M) * K + rank.reshape(-1).index_select(0, rows)
    return rows, at, K, rank


def _compact(x: Tensor, rows: Tensor, at: Tensor, size: int, fill: float = 0.0) -> Tensor:
    """The rows ``rows`` of x [B, H, M, ...] (flat) copied to rows ``at`` of a [size, ...] tensor
    filled with ``fill`` elsewhere (``_compaction``'s renumbering)."""
    flat = x.reshape(-1, x.shape[-1]) if x.dim() == 4 else x.reshape(-1)
    return flat.new_full((size, *flat.shape[1:]), fill).index_copy_(0, at, flat.index_select(0, rows))


def _flat_index(index: Tensor, width: int) -> Tensor:
    """[B, H, N] indices into rows of ``width`` -> [B * H * N] indices into the flat [B * H * width]."""
    B, H, N = index.shape
    return (torch.arange(B * H, device=index.device)[:, None] * width + index.reshape(B * H, N)).reshape(-1)


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differs_from(keys: Tensor, other: Tensor) -> Tensor:
    """[B, H, N] bool: slot n's key is not bitwise equal to slot other[n]'s (other: [B, H, N] long).
    Exact: only the slots whose other slot is not themselves are compared, bit pattern by bit
    pattern (a representative's own members are the merged ones: a fraction of the slots)."""
    B, H, N, D = keys.shape
    bits = keys.reshape(B * H * N, D).view(_INT_OF[keys.element_size()])
    index = _flat_index(other, N)
    pairs = (index != torch.arange(index.numel(), device=index.device)).nonzero().squeeze(1)
    differs = torch.zeros(B * H * N, dtype=torch.bool, device=keys.device)
    if pairs.numel():
        differs[pairs] = (bits.index_select(0, pairs) != bits.index_select(0, index.index_select(0, pairs))).any(-1)
    return differs.view(B, H, N)


