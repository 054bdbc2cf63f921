"""fit_clusters against an obviously-correct slow reference: one Python loop per head and cluster,
the docstring's formulas written out in float64 with no flat indexing and no separable shortcut."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress.strategies.fitted import _differs_from
from kvcompress.strategies.fitting import (MAX_LOG_RATIO, SETTLED, SOFT_SIGN_KNEE, TINY, VALUE_RIDGE, fit_clusters,
                                           refine_jointly, row_part)


def _weights(share: torch.Tensor, seen: torch.Tensor, power: float):
    w = torch.where(seen, share, 0.0)
    if power != 1.0 and bool(seen.any()):
        w = torch.where(seen, (share / w.max()).pow(power), 0.0)
    total = float(w.sum())
    if total <= 0:
        return torch.zeros_like(w), 0.0
    norm = w / total
    return norm, 1.0 / float(norm.square().sum())


def _shrink(n_eff: float, ridge: float) -> float:
    return float(n_eff == 0) if ridge == 0 else ridge / (n_eff + ridge)


def slow_fit(keys, values, bias, cluster, queries, prior_keys, prior_values, prior_bias, *, scale,
             power=1.0, ridge=1.0, key="mean"):
    """One loop iteration per (batch, head, cluster), in float64."""
    B, H, N, D = keys.shape
    M, P = prior_bias.shape[-1], queries.shape[2]
    out_k = prior_keys.double().clone()
    out_v = prior_values.double().clone()
    out_b = prior_bias.double().clone()
    for b in range(B):
        for h in range(H):
            k, v, s_b = keys[b, h].double(), values[b, h].double(), bias[b, h].double()
            q = queries[b, h].double()
            s = q @ k.T * scale + s_b  # [P, N]
            top = s.max(-1, keepdim=True).values
            top = torch.where(top > -math.inf, top, 0.0)
            e = (s - top).exp()
            z = e.sum(-1)  # [P]
            row_out = (e @ v) / z.clamp(min=1.0)[:, None]  # [P, D]
            for c in range(M):
                member = cluster[b, h] == c
                if not bool(member.any()):
                    continue
                mass = e[:, member].sum(-1)  # [P], relative to each row's top
                seen = mass > TINY
                share = (mass / z.clamp(min=1.0)).clamp(max=1.0)
                norm, n_eff = _weights(share, seen, power)
                alpha = _shrink(n_eff, ridge)
                p = e[:, member] / mass.clamp(min=TINY)[:, None]  # [P, |C|] members' shares of the cluster
                # with power 1 the members' weights are the attention they receive, summed over
                # every query (seen or not); otherwise sum_r norm_r p_ir over the seen queries
                received = (e[:, member] / z.clamp(min=1.0)[:, None]).sum(0)  # [|C|]
                slot_key = prior_keys[b, h, c].double()
                if key == "attention":
                    if power == 1.0:
                        total = float(received.sum())
                        fitted = received @ k[member] / total if total > 0 else torch.zeros(D, dtype=torch.float64)
                    else:
                        fitted = (norm[:, None] * p).sum(0) @ k[member]
                    slot_key = torch.lerp(fitted, slot_key, alpha).to(keys.dtype).double()
                y = torch.where(seen, mass.clamp(min=TINY).log() + top[:, 0] - q @ slot_key * scale, 0.0)
                beta = (1 - alpha) * float((norm * y).sum()) + alpha * float(prior_bias[b, h, c])
                rho = torch.where(seen, (y - beta).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp(), 1.0)
                # query r weighs (m'_r / Z_r) ** power: the fitted slot's share of the row
                norm2, n_eff2 = _weights(share / rho, seen, power)
                alpha_v = _shrink(n_eff2, ridge)
                o = p @ v[member]  # [P, D] the cluster's own output per query
                if power == 1.0:  # norm2 rho o = share o / sum(share / rho): over every query
                    total2 = float(torch.where(seen, share / rho, 0.0).sum())
                    own = received @ v[member] / total2 if total2 > 0 else torch.zeros(D, dtype=torch.float64)
                else:
                    own = (norm2[:, None] * rho[:, None] * o).sum(0)
                value = own + (norm2[:, None] * (1 - rho[:, None]) * row_out).sum(0)
                out_k[b, h, c] = slot_key
                out_b[b, h, c] = beta
                out_v[b, h, c] = (1 - alpha_v) * value + alpha_v * prior_values[b, h, c].double()
    return out_k, out_v, out_b


def _top(x: torch.Tensor) -> torch.Tensor:
    return x.max() if x.numel() else torch.tensor(0.0)


def _case(seed, B, H, N, M, D, P, pad, faint):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g)
    values = torch.randn(B, H, N, D, generator=g)
    bias = torch.randint(1, 4, (B, H, N), generator=g).float().log()
    cluster = torch.randint(-1, M, (B, H, N), generator=g)
    if pad:
        bias[..., :pad] = -math.inf
        cluster[..., :pad] = -1
    queries = 2.0 * torch.randn(B, H, P, D, generator=g)
    if faint:  # one query that sees almost nothing but one key direction
        queries[..., 0, :] = 0
        queries[..., 0, 0] = 60.0
    prior_keys = torch.randn(B, H, M, D, generator=g)
    prior_values = torch.randn(B, H, M, D, generator=g)
    prior_bias = torch.rand(B, H, M, generator=g) * 2
    return keys, values, bias, cluster, queries, prior_keys, prior_values, prior_bias


@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(2, 40),
       M=st.integers(1, 8), D=st.sampled_from([2, 4, 8]), P=st.integers(1, 12), pad=st.integers(0, 3),
       faint=st.booleans(), power=st.sampled_from([1.0, 2.0]), ridge=st.sampled_from([0.0, 1.0, 4.0]),
       key=st.sampled_from(["mean", "attention"]))
@settings(CORE_SETTINGS, max_examples=80)
# a faint query that sees a singleton 6.6e-30 of its top: the value step's share / rho falls below
# TINY, where the normaliser once clamped at TINY (the value came out -7.7 instead of -31.4)
@example(seed=3681, B=1, H=2, N=4, M=2, D=2, P=1, pad=0, faint=True, power=1.0, ridge=1.0, key="mean")
def test_fit_clusters_equals_the_slow_per_cluster_loop(seed, B, H, N, M, D, P, pad, faint, power, ridge, key):
    """The vectorised fit equals the loop over heads and clusters (float64) to 2e-4 relative."""
    pad = min(pad, N - 1)
    args = _case(seed, B, H, N, M, D, P, pad, faint)
    scale = 1 / math.sqrt(D)
    got = fit_clusters(*args, scale=scale, power=power, ridge=ridge, key=key)
    want_k, want_v, want_b = slow_fit(*args, scale=scale, power=power, ridge=ridge, key=key)
    cluster = args[3]
    # clusters without members are not the fit's business (the merger never passes them)
    present = torch.zeros(B, H, M + 1, dtype=torch.bool).scatter_(-1, torch.where(cluster >= 0, cluster, M), True)[..., :M]
    for got_x, want_x in ((got.keys, want_k), (got.values, want_v), (got.bias, want_b)):
        err = float(_top((got_x.double() - want_x).abs()[present]))
        assert err <= 2e-4 * (1 + float(_top(want_x[present].abs()))), err
    assert bool(torch.isfinite(got.keys).all() and torch.isfinite(got.values).all() and torch.isfinite(got.bias).all())


@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(3, 40),
       M=st.integers(1, 8), D=st.sampled_from([2, 4, 8]), P=st.integers(1, 12), pad=st.integers(0, 3),
       power=st.sampled_from([1.0, 2.0]), key=st.sampled_from(["mean", "attention"]), out=st.floats(0.1, 0.9))
@settings(CORE_SETTINGS, max_examples=60)
def test_slots_summed_apart_count_in_the_rows_as_when_passed(seed, B, H, N, M, D, P, pad, power, key, out):
    """fit_clusters(others, rest=row_part(apart)) equals fit_clusters(all) to float32 rounding, when the
    slots set apart belong to no cluster (the staying slots of a merge): they count in every row's
    mass and output either way. The set-apart slots' rows are padding in ``others`` and vice versa."""
    pad = min(pad, N - 1)
    keys, values, bias, cluster, queries, pk, pv, pb = _case(seed, B, H, N, M, D, P, pad, False)
    scale = 1 / math.sqrt(D)
    g = torch.Generator().manual_seed(seed + 1)
    apart = (cluster < 0) & (torch.rand(B, H, N, generator=g) < out)
    whole = fit_clusters(keys, values, bias, cluster, queries, pk, pv, pb, scale=scale, power=power, key=key)
    rest = row_part(keys, values, bias.masked_fill(~apart, -math.inf), queries, scale)
    split = fit_clusters(keys, values, bias.masked_fill(apart, -math.inf), cluster, queries, pk, pv, pb,
                         scale=scale, power=power, key=key, rest=rest)
    present = torch.zeros(B, H, M + 1, dtype=torch.bool).scatter_(-1, torch.where(cluster >= 0, cluster, M), True)[..., :M]
    for got, want in ((split.keys, whole.keys), (split.values, whole.values), (split.bias, whole.bias)):
        got, want = got[present].double(), want[present].double()
        assert float(_top((got - want).abs())) <= 1e-4 * (1 + float(_top(want.abs())))
    assert float((split.targets - whole.targets).abs().max()) <= 1e-5 * (1 + float(whole.targets.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@given(seed=st.integers(0, 10_000))
@settings(CORE_SETTINGS, max_examples=20)
def test_identical_keys_are_found_bit_for_bit(dtype, seed):
    """The XOR test says "differs" exactly when some bit of the key differs: copies are equal;
    a sign flip (x vs -x, 0.0 vs -0.0) or one changed element differ."""
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = 2, 2, 12, 6
    keys = torch.randn(B, H, N, D, generator=g).to(dtype)
    other = torch.randint(0, N, (B, H, N), generator=g)
    src = keys.gather(2, other[..., None].expand(B, H, N, D))
    # 0: own key, 1: copy, 2: sign flip, 3: one element, 4: the elements reversed (the same bits in
    # another order: the same sum of bit patterns, a different key)
    kind = torch.randint(0, 5, (B, H, N), generator=g)
    keys = torch.where((kind == 1)[..., None], src, keys)
    keys = torch.where((kind == 2)[..., None], -src, keys)
    bumped = src.clone()
    bumped[..., 0] = torch.where(bumped[..., 0] == 0, 1.0, bumped[..., 0] * 2).to(dtype)
    keys = torch.where((kind == 3)[..., None], bumped, keys)
    keys = torch.where((kind == 4)[..., None], src.flip(-1), keys)
    keys[0, 0, 0] = 0.0
    keys[0, 0, 1] = -0.0 * torch.ones(D, dtype=dtype)
    other[0, 0, 1] = 0
    rep = keys.gather(2, other[..., None].expand(B, H, N, D))
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[keys.element_size()]
    want = (keys.view(ints) != rep.view(ints)).any(-1)
    assert torch.equal(_differs_from(keys, other), want)
    assert bool(_differs_from(keys, other)[0, 0, 1])  # -0.0 against 0.0: a different bit pattern


def slow_refine(keys, values, bias, fit, queries, targets, *, scale, steps, step):
    """refine_jointly written out per (batch, head) in float64: the key gradient by autograd, the
    value correction by the primal ridge least squares over the fitted slots (F x F)."""
    B, H, M, D = keys.shape
    out_k, out_v = keys.double().clone(), values.double().clone()
    for b in range(B):
        for h in range(H):
            k, v, s_b = keys[b, h].double(), values[b, h].double(), bias[b, h].double()
            q, target, f = queries[b, h].double(), targets[b, h].double(), fit[b, h]

            def attention(k):
                s = q @ k.T * scale + s_b  # [P, M]
                if not bool(torch.isfinite(s).any()):
                    return torch.zeros_like(s)
                return s.softmax(-1).nan_to_num(0.0)  # a row of padding only: no attention

            def err(k):
                return float((attention(k) @ v - target).square().sum())

            lr = step / (scale * float(q.abs().sum(-1).mean()))
            best, best_err = k, err(k)
            for _ in range(steps):
                kk = best.clone().requires_grad_(True)
                (attention(kk) @ v - target).square().sum().backward()
                grad = kk.grad * f[:, None]
                knee = SOFT_SIGN_KNEE * grad.abs().amax(-1, keepdim=True)
                gate = min(1.0, math.sqrt(best_err / max(float(target.square().sum()), TINY)) / SETTLED)
                soft = torch.where(knee > 0, grad / (grad.abs() + knee), 0.0)
                new = best - lr * gate * soft
                new_err = err(new)
                if new_err <= best_err:
                    best, best_err = new, new_err
                else:
                    lr /= 2
            a = attention(best)[:, f]  # [P, F]
            res = target - attention(best) @ v
            if a.numel() and float(a.square().sum()) > 0:
                ridge = VALUE_RIDGE * float(a.square().sum()) / a.shape[0]
                delta = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=a.dtype), a.T @ res)
                v = v.clone()
                v[f] += delta
            out_k[b, h], out_v[b, h] = best, v
    return out_k, out_v


@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 2), M=st.integers(1, 12),
       D=st.sampled_from([2, 4, 8]), P=st.integers(1, 10), pad=st.integers(0, 2), steps=st.integers(0, 3),
       step=st.sampled_from([0.2, 0.7, 2.0]), near=st.booleans())
@settings(CORE_SETTINGS, max_examples=60)
def test_refine_jointly_equals_the_slow_per_head_loop(seed, B, H, M, D, P, pad, steps, step, near):
    """The vectorised joint refinement equals autograd steps and a primal ridge solve per head."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, M, D, generator=g)
    values = torch.randn(B, H, M, D, generator=g)
    bias = torch.randint(1, 4, (B, H, M), generator=g).float().log()
    pad = min(pad, M - 1)
    bias[..., :pad] = -math.inf
    fit = torch.rand(B, H, M, generator=g) < 0.6
    fit[..., :pad] = False
    queries = 1.5 * torch.randn(B, H, P, D, generator=g)
    scale = 1 / math.sqrt(D)
    a = (torch.einsum("bhpd,bhmd->bhpm", queries, keys) * scale + bias[:, :, None]).softmax(-1)
    exact = a @ values
    # targets near the slots' own outputs (an almost settled head) or anywhere
    targets = exact + (1e-4 if near else 0.5) * torch.randn(B, H, P, D, generator=g)
    # the moving slots are the fitted ones (the others' rows empty: bias -inf), the rest of the rows the others
    rest = row_part(keys, values, bias.masked_fill(fit, -math.inf), queries, scale)
    got_k, got_v = refine_jointly(keys, values, bias.masked_fill(~fit, -math.inf), rest, queries, targets,
                                  scale=scale, steps=steps, step=step, dtype=torch.float32)
    want_k, want_v = slow_refine(keys, values, bias, fit, queries, targets, scale=scale, steps=steps, step=step)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert bool(torch.isfinite(got).all())
        err = float((got.double() - want).abs().max())
        assert err <= 1e-3 * (1 + float(want.abs().max())), err
    # only the fitted slots move, and not at all for the others (bit for bit)
    assert torch.equal(got_k[~fit], keys[~fit]) and torch.equal(got_v[~fit], values[~fit])
    # the error over the reference queries never rises
    def out_err(k, v):
        att = (torch.einsum("bhpd,bhmd->bhpm", queries, k) * scale + bias[:, :, None]).softmax(-1)
        return float((att @ v - targets).square().sum())
    assert out_err(got_k, got_v) <= out_err(keys, values) * (1 + 1e-5) + 1e-9


# session 14: the cluster sums as sparse CSR products, the rows' numerators as (v^T e)^T
@given(seed=st.integers(0, 10_000), S=st.integers(1, 60), C=st.integers(1, 9), E=st.integers(1, 12),
       weighted=st.booleans(), none=st.booleans())
@settings(CORE_SETTINGS, max_examples=60)
def test_member_sums_equal_index_add_within_rounding(seed, S, C, E, weighted, none):
    """_Members.sum equals index_add_ of the (weighted) rows into their clusters, the non-members
    (row C) dropped, to 1e-6 of the largest absolute sum (float32 rounding: the sparse product may
    fuse the weight's multiply into the add); with no weight, to the same bound (in practice exact)."""
    from kvcompress.strategies.fitting import _Members
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, C + 1, (S,), generator=g)
    if none:  # no slot is a member
        flat[:] = C
    x = torch.randn(S, E, generator=g) * 10 ** torch.randint(-3, 4, (S, 1), generator=g).float()
    w = torch.rand(S, generator=g) if weighted else None
    got = _Members(flat, C, S).sum(w, x)
    src = x.double() * (w.double()[:, None] if weighted else 1.0)
    want = torch.zeros(C + 1, E, dtype=torch.float64).index_add_(0, flat, src)[:C]
    bound = 1e-6 * float(src.abs().sum(0).max()) + 1e-30 if S else 1e-30
    assert got.shape == (C, E) and got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= bound


@given(seed=st.integers(0, 10_000), N=st.integers(1, 300), P=st.integers(1, 40), D=st.sampled_from([2, 8, 64]))
@settings(CORE_SETTINGS, max_examples=40)
def test_numerators_are_the_plain_product_within_rounding(seed, N, P, D):
    """_numerators(e, v) = e^T v to 1e-6 relative (float64 reference), contiguous; one slot of weight 1
    gives its value exactly (the joint steps' gradient of a one-slot row is then exactly 0)."""
    from kvcompress.strategies.fitting import _numerators
    g = torch.Generator().manual_seed(seed)
    e, v = torch.rand(1, 2, N, P, generator=g), torch.randn(1, 2, N, D, generator=g)
    got = _numerators(e, v)
    want = e.double().transpose(-1, -2) @ v.double()
    assert got.is_contiguous() and got.shape == (1, 2, P, D)
    assert float((got.double() - want).abs().max()) <= 1e-6 * float((e.double().transpose(-1, -2) @ v.double().abs()).max())
    assert torch.equal(_numerators(torch.ones(1, 1, 1, P), v[:, :1, :1]), v[:, :1, :1].expand(1, 1, P, D))


@given(seed=st.integers(0, 10_000), R=st.integers(1, 20), P=st.integers(1, 40), exponent=st.integers(-44, 2))
@settings(CORE_SETTINGS, max_examples=60)
def test_linear_weights_are_the_normalised_ones_within_rounding(seed, R, P, exponent):
    """_linear_weights' n_eff and 1 / sum equal _weights(w, 1.0)'s to 1e-5 relative, for shares down
    to 1e-44 of a row (faint rows, whose squares underflow, take the normalised squares), unseen
    queries (0) and rows no query sees."""
    from kvcompress.strategies.fitting import _linear_weights, _weights
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(R, P, generator=g) * 10.0 ** (exponent + 4 * torch.rand(R, 1, generator=g) - 2)
    w = torch.where(torch.rand(R, P, generator=g) < 0.3, 0.0, w)
    w[0] = 0.0  # a row no query sees
    want_norm, want_n, want_inv = _weights(w, 1.0)
    got_n, got_inv = _linear_weights(w)
    assert torch.equal(got_inv, want_inv)
    assert torch.equal(got_n == 0, want_n == 0)
    assert float(((got_n - want_n).abs() / want_n.clamp(min=1e-30)).max()) <= 1e-5
