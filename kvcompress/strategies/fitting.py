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
  v = rho_r o_r + (1 - rho_r) O_r (rho_r = m_r / m'_r, O_r the full row's output), an error of
  a'_r (v - target_r) otherwise (a'_r the slot's share of the refitted row). The least-squares v
  is the a'^power-weighted mean of those targets, i.e. a weighted mean of the members' values plus
  a weighted mean of the rows' outputs: no [P, M, D] tensor is ever formed.
* key (optional, ``key="attention"``): the members' keys weighted by the attention they receive
  from the weighted queries (the average gradient of the cluster's log-mass, which is the least-
  squares slope for Gaussian-like queries), then beta refitted for it.

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


def _weights(share: Tensor, seen: Tensor, power: float) -> tuple[Tensor, Tensor]:
    """Per-slot query weights share ** power, normalised over the queries.

    share: [..., P] in [0, 1], seen: [..., P] bool (weight 0 where False)
    returns norm [..., P] (sums to 1, or 0 where no query sees the slot), n_eff = (sum w)^2 / sum w^2
    (the effective number of queries, 0 if none); both invariant to the scale of w
    """
    if power == 1.0:
        w = torch.where(seen, share, 0.0)
    else:  # relative to the largest share first: a high power would underflow small shares
        top = torch.where(seen, share, 0.0).amax(-1, keepdim=True).clamp(min=TINY)
        w = torch.where(seen, (share / top).pow(power), 0.0)
    total = w.sum(-1, keepdim=True)
    norm = w.div_(total.clamp(min=TINY))  # in [0, 1]: its squares cannot underflow as w's might
    n_eff = torch.where(total[..., 0] > 0, 1.0 / norm.square().sum(-1).clamp(min=TINY), 0.0)
    return norm, n_eff


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

    # flat cluster row of every slot; dropped slots and padding go to a dummy row per head
    cl = torch.where(cluster >= 0, cluster, M)
    flat = (torch.arange(rows, device=dev)[:, None] * (M + 1) + cl.reshape(rows, N)).reshape(-1)  # [B*H*N]
    mass = e.new_zeros(rows * (M + 1), P).index_add_(0, flat, e_flat).view(B, H, M + 1, P)[:, :, :M]
    seen = mass > TINY  # [B, H, M, P]
    log_mass = mass.clamp(min=TINY).log_().add_(top)  # log m (used only where seen)
    share = torch.div(mass, z.clamp(min=1.0)[:, :, None]).clamp_(max=1.0)  # m / Z, the cluster's share of the row

    def member_mean(coef: Tensor, x: Tensor) -> Tensor:
        """sum_i (sum_r coef[cl(i), r] p_ir) x_i per cluster, p_ir = e_ir / mass_r the member's
        share of its cluster's mass: coef [B, H, M, P] (0 where unseen), x [B, H, N, E]."""
        c = coef.new_zeros(B, H, M + 1, P)  # row M: the dummy cluster
        torch.div(coef, mass.clamp(min=TINY), out=c[:, :, :M]).mul_(seen)
        c = c.view(rows * (M + 1), P)
        u = c.index_select(0, flat).mul_(e_flat).sum(-1, keepdim=True)  # [B*H*N, 1]
        out = x.new_zeros(rows * (M + 1), x.shape[-1]).index_add_(0, flat, x.reshape(rows * N, -1) * u)
        return out.view(B, H, M + 1, -1)[:, :, :M]

    norm, n_eff = _weights(share, seen, power)  # [B, H, M, P], [B, H, M]
    alpha = _shrink(n_eff, ridge)  # [B, H, M]
    slot_keys = prior_keys.float()
    if key == "attention":
        fitted = member_mean(norm, k32)
        # attention sees the key in the cache's dtype: fit the bias to that key
        slot_keys = torch.lerp(fitted, slot_keys, alpha[..., None]).to(keys.dtype).float()

    t0 = torch.matmul(slot_keys, q_aug[..., :D].transpose(-1, -2))  # the merged slot's logit, bias aside
    seen_f = seen.float()
    y = log_mass.sub_(t0).mul_(seen_f)  # log m - q.k: the bias each query asks for (0 where unseen)
    beta_fit = torch.linalg.vecdot(norm, y)
    beta = torch.lerp(beta_fit, prior_bias.float(), alpha)

    # values: targets rho o_r + (1 - rho) O_r, weighted by the refitted shares a'_r ** power
    rho = y.sub_(beta[..., None]).clamp_(-MAX_LOG_RATIO, MAX_LOG_RATIO).mul_(seen_f).exp_()  # 1 where unseen
    # the slot's share of the refitted row: m' = m / rho of Z' = Z - m + m', i.e.
    # share / (rho (1 - share) + share); the denominator is >= min(rho, 1) > 0
    one_minus_rho = torch.sub(1.0, rho)
    share2 = share / torch.addcmul(rho, share, one_minus_rho)
    norm2, n_eff2 = _weights(share2, seen, power)
    alpha_v = _shrink(n_eff2, ridge)
    # the full rows' outputs O_r [B, H, P, D] (a row of padding only: no output)
    row_out = torch.matmul(e.transpose(-1, -2), v32) / z.clamp(min=1.0)[..., None]
    value_fit = member_mean(norm2 * rho, v32).add_(torch.matmul(one_minus_rho.mul_(norm2), row_out))
    slot_values = torch.lerp(value_fit, prior_values.float(), alpha_v[..., None])
    return FitResult(keys=slot_keys, values=slot_values, bias=beta, n_eff=n_eff)
