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

Both fits shrink toward the proportional answer (mean value, beta = log sum exp(b)) with
``ridge`` pseudo-queries against the weights' effective number of queries, so a cluster no
reference query looks at keeps the proportional answer. Everything is computed in float32 on
flat [rows, P] tensors with index_add / index_reduce over members: no loop per slot or head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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
    """

    keys: Tensor
    values: Tensor
    bias: Tensor
    n_eff: Tensor


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
    inv = torch.where(total > 0, total.clamp(min=TINY).reciprocal(), 0.0)
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
    k_aug = torch.cat([k32, bias.float()[..., None]], dim=-1)
    q_aug = torch.cat([queries.float() * scale, queries.new_ones(B, H, P, 1, dtype=torch.float32)], dim=-1)
    s = torch.matmul(k_aug, q_aug.transpose(-1, -2))
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
        # and sum_i a_i v_i in one scatter of [keys | values] * a (sum_i a_i = sum_r share_r)
        a = torch.einsum("bhnp,bhp->bhn", e, zc.reciprocal())[..., None]  # [B, H, N, 1]
        parts = (k32, v32) if key != "mean" else (v32,)
        x = e.new_empty(B, H, N, D * len(parts))
        for j, part in enumerate(parts):
            torch.mul(part, a, out=x[..., j * D:(j + 1) * D])
        x = x.view(rows * N, -1)
        sums = x.new_zeros(rows * M + 1, x.shape[1]).index_add_(0, flat, x)[: rows * M].view(B, H, M, -1)
    slot_keys = prior_keys.float()
    if key != "mean":
        fitted = sums[..., :D] * inv if separable else member_mean(norm, k32)
        # attention sees the key in the cache's dtype: fit the bias to that key
        slot_keys = torch.lerp(fitted, slot_keys, alpha[..., None]).to(keys.dtype).float()

    # log m - q.k: the bias each query asks for (finite where unseen, where its weight is 0)
    y = log_mass_of(mass, top).sub_(torch.matmul(slot_keys, q_aug[..., :D].transpose(-1, -2)))
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
    return FitResult(keys=slot_keys, values=slot_values, bias=beta, n_eff=n_eff)
