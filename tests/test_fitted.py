"""The fitted merger: reproduces the clusters' attention on the reference queries, keeps the
proportional answer where it is exact, stays finite, and treats a bias beta as exp(beta) copies."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress.attention import expand_state, proportional_attention
from kvcompress.protocols import Needs
from kvcompress.registry import MERGERS
from kvcompress.strategies.fitted import FittedMerger, cluster_index
from kvcompress.strategies.mergers import apply_merge_plan
from kvcompress.types import KVState


def fitted(**params) -> FittedMerger:
    """The merger fitted to extras["reference_queries"] (the queries these tests build)."""
    return FittedMerger(**{"queries": "prefill", **params})


def clustered_state(seed: int, B=1, H=2, N=96, D=16, G=2, R=24, size=4, spread=0.3, qspread=0.1, qnorm=2.0):
    """Keys drawn around one centre per run of ``size`` slots (what a clusterer merges), random
    values, and reference queries around one direction per query head (real heads' queries are
    concentrated). Returns the state (with extras["reference_queries"]) and a plan merging each run."""
    g = torch.Generator().manual_seed(seed)
    run = torch.arange(N) // size
    centres = torch.randn(B, H, N, D, generator=g)[:, :, run]
    keys = centres + spread * torch.randn(B, H, N, D, generator=g)
    values = torch.randn(B, H, N, D, generator=g)
    mu = torch.randn(B, H * G, 1, D, generator=g)
    q = (mu + qspread * torch.randn(B, H * G, R, D, generator=g)) * qnorm * D ** 0.25
    state = KVState.from_raw(keys, values).replace(extras={"reference_queries": q})
    parent = (run * size).expand(B, H, N).clone()
    return state, parent


def outputs(state: KVState, q: torch.Tensor) -> torch.Tensor:
    return proportional_attention(q, state.keys, state.values, state.log_sizes, causal=False)


def rel_err(state: KVState, ref: torch.Tensor, q: torch.Tensor) -> float:
    return float((outputs(state, q) - ref).norm() / ref.norm())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("key", ["mean", "attention"])
def test_fitted_slots_reproduce_cluster_attention_far_better_than_the_mean(seed, key):
    """One query head per KV head: the fitted slots' error on the reference queries is >= 5x lower."""
    state, parent = clustered_state(seed, D=32, G=1)
    q = state.extras["reference_queries"]
    full = outputs(state, q)
    mean_err = rel_err(apply_merge_plan(state, parent), full, q)
    fit_err = rel_err(fitted(key=key)(state, parent), full, q)
    assert mean_err > 0.3  # the clusters are far from exact under the mean rule
    assert fit_err * 5 <= mean_err, (mean_err, fit_err)


@pytest.mark.parametrize("seed", range(4))
def test_grouped_query_heads_still_halve_the_error(seed):
    """Two query heads share a KV head: one slot cannot follow both heads' outputs exactly (one
    value for two targets), the fit must still at least halve the mean rule's error."""
    state, parent = clustered_state(seed, G=2)
    q = state.extras["reference_queries"]
    full = outputs(state, q)
    mean_err = rel_err(apply_merge_plan(state, parent), full, q)
    fit_err = rel_err(fitted(key="attention")(state, parent), full, q)
    assert fit_err * 2 <= mean_err, (mean_err, fit_err)


def test_joint_steps_lower_the_per_cluster_fits_error_on_its_queries_and_on_fresh_ones():
    """Two query heads per KV head, clusters of 4 and 8: the joint key steps and value solve
    (refine) never raise the closed form's error on the reference queries, lower it by 3% or more
    in every case, on fresh queries of the same heads too, and by a quarter on average."""
    ratios = []
    for seed in range(6):
        for size, spread in ((4, 0.3), (8, 0.5)):
            state, parent = clustered_state(seed, G=2, size=size, spread=spread)
            q = state.extras["reference_queries"]
            g = torch.Generator().manual_seed(99 + seed)
            fresh = q.mean(2, keepdim=True) + 0.1 * 2.0 * 16 ** 0.25 * torch.randn(q.shape, generator=g)
            closed, joint = fitted(refine=0)(state, parent), fitted()(state, parent)
            for queries in (q, fresh):
                full = outputs(state, queries)
                ratio = rel_err(joint, full, queries) / rel_err(closed, full, queries)
                assert ratio <= 0.97, (seed, size, ratio)
                ratios.append(ratio)
    assert sum(ratios) / len(ratios) <= 0.8, ratios


def test_fitted_generalises_to_fresh_queries_of_the_same_heads():
    state, parent = clustered_state(7)
    g = torch.Generator().manual_seed(99)
    q = state.extras["reference_queries"]
    mu = q.mean(2, keepdim=True)
    fresh = mu + 0.1 * 2.0 * 16 ** 0.25 * torch.randn(q.shape, generator=g)
    full = outputs(state, fresh)
    mean_err = rel_err(apply_merge_plan(state, parent), full, fresh)
    fit_err = rel_err(fitted()(state, parent), full, fresh)
    assert fit_err * 3 <= mean_err, (mean_err, fit_err)


def _identical_and_singletons_kept(fit: KVState, mean: KVState) -> None:
    for x, y in ((fit.keys, mean.keys), (fit.values, mean.values), (fit.log_sizes[..., None], mean.log_sizes[..., None])):
        assert torch.equal(x[..., 1, :], y[..., 1, :]) and torch.equal(x[..., 4:, :], y[..., 4:, :])


def test_identical_members_and_singletons_are_the_mean_rule_bit_for_bit():
    state, parent = clustered_state(3, N=32)
    g = torch.Generator().manual_seed(1)
    keys = state.keys.clone()
    keys[..., 4:8, :] = keys[..., 4:5, :]  # one cluster of identical keys (values differ)
    sizes = torch.randint(1, 4, state.log_sizes.shape, generator=g).float()
    state = state.replace(keys=keys, log_sizes=sizes.log())
    parent = parent.clone()
    parent[..., 16:] = torch.arange(16, 32)  # singletons
    mean = apply_merge_plan(state, parent)
    for fit in (fitted(key="attention")(state, parent), fitted(key="attention", refine_share=0.25)(state, parent)):
        _identical_and_singletons_kept(fit, mean)
    fit = fitted(key="attention")(state, parent)
    assert torch.equal(fit.keys[..., 1, :], mean.keys[..., 1, :])
    assert torch.equal(fit.values[..., 1, :], mean.values[..., 1, :])
    assert torch.equal(fit.log_sizes[..., 1], mean.log_sizes[..., 1])
    assert torch.equal(fit.keys[..., 4:, :], mean.keys[..., 4:, :])
    assert torch.equal(fit.values[..., 4:, :], mean.values[..., 4:, :])
    assert torch.equal(fit.log_sizes[..., 4:], mean.log_sizes[..., 4:])
    assert torch.equal(fit.positions, mean.positions)
    # the clusters that differ were fitted; with the mean key, their bias is above log(size):
    # by Jensen's inequality the mean rule under-states every query's mass
    assert not torch.equal(fit.log_sizes[..., 0], mean.log_sizes[..., 0])
    fit_mean_key = fitted(key="mean")(state, parent)
    assert bool((fit_mean_key.log_sizes[..., :4] >= mean.log_sizes[..., :4] - 1e-5).all())


def test_a_plan_of_singletons_and_drops_only_is_the_mean_merger():
    state, _ = clustered_state(0, N=16)
    parent = torch.arange(16).expand(1, 2, 16).clone()
    parent[..., 3] = -1
    out = fitted()(state, parent)
    mean = apply_merge_plan(state, parent)
    for a, b in ((out.keys, mean.keys), (out.values, mean.values), (out.log_sizes, mean.log_sizes)):
        assert torch.equal(a, b)
    assert fitted()(state, torch.arange(16).expand(1, 2, 16)) is state


@given(seed=st.integers(0, 10_000), n=st.integers(2, 20), d=st.sampled_from([2, 4, 8]),
       sizes=st.booleans(), key=st.sampled_from(["mean", "attention"]))
@CORE_SETTINGS
def test_one_reference_query_is_reproduced_exactly(seed, n, d, sizes, key):
    """With one reference query per KV head and no ridge, every cluster's mass and output for that
    query are matched, so the fitted state's attention equals the expanded cache's."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, n, d, generator=g)
    values = torch.randn(1, 2, n, d, generator=g)
    state = KVState.from_raw(keys, values)
    if sizes:
        state = state.replace(log_sizes=torch.randint(1, 4, (1, 2, n), generator=g).float().log())
    q = 2 * torch.randn(1, 2, 1, d, generator=g)
    state = state.replace(extras={"reference_queries": q})
    # a random plan without drops: each slot merges into an earlier representative or keeps itself
    parent = torch.arange(n).expand(1, 2, n).clone()
    for h in range(2):
        reps = [0]
        for i in range(1, n):
            if float(torch.rand((), generator=g)) < 0.6:
                parent[0, h, i] = reps[int(torch.randint(0, len(reps), (), generator=g))]
            else:
                reps.append(i)
    fit = fitted(ridge=0.0, key=key)(state, parent)
    ek, ev, els = expand_state(state)
    full = proportional_attention(q, ek, ev, els, causal=False)
    got = outputs(fit, q)
    assert torch.allclose(got, full, atol=1e-4, rtol=1e-4), float((got - full).abs().max())


@given(seed=st.integers(0, 10_000), key=st.sampled_from(["mean", "attention"]), power=st.sampled_from([1.0, 2.0]))
@CORE_SETTINGS
def test_refitting_a_state_equals_fitting_its_expanded_cache(seed, key, power):
    """A slot with bias log(s) is s copies for the fit: merging a state with sizes gives the
    same slots as merging its expanded cache with every copy in its slot's cluster."""
    g = torch.Generator().manual_seed(seed)
    H, n, d = 2, 12, 4
    sizes = torch.randint(1, 4, (1, H, n), generator=g)
    keys = torch.randn(1, H, n, d, generator=g)
    state = KVState.from_raw(keys, torch.randn(1, H, n, d, generator=g))
    q = torch.randn(1, 2 * H, 5, d, generator=g)
    state = state.replace(log_sizes=sizes.float().log(), extras={"reference_queries": q})
    parent = torch.arange(n).expand(1, H, n).clone()
    parent[..., 1::3] -= 1  # pairs (3j, 3j + 1); slot 3j + 2 alone
    ek, ev, els = expand_state(state)
    # sizes are equal per head only by chance; expand per head and keep rows of equal length
    T = int(sizes.sum(-1).max())
    plans = []
    for h in range(H):
        copies = torch.arange(n).repeat_interleave(sizes[0, h])  # original slot of every copy
        first = torch.cumsum(sizes[0, h], 0) - sizes[0, h]  # first copy of every original slot
        rep_copy = first[parent[0, h, copies]]  # the copy representing each copy's cluster
        plan = torch.full((T,), -1, dtype=torch.long)
        plan[: copies.numel()] = rep_copy
        plans.append(plan)
    expanded = KVState(keys=ek, values=ev, log_sizes=els, num_tokens=T,
                       positions=torch.arange(T).expand(1, H, T).clone(), extras={"reference_queries": q})
    # the closed form to rounding; the joint steps after it to their amplified rounding (a soft
    # sign step of ~0.7 logits and an accept / reject by the error turn 1e-7 into ~1e-5)
    for refine, tol in ((0, 1e-5), (3, 1e-3)):
        merger = fitted(key=key, power=power, refine=refine)
        a = merger(state, parent)
        b = merger(expanded, torch.stack(plans)[None])
        M = a.num_slots
        assert torch.allclose(a.log_sizes, b.log_sizes[..., :M], atol=tol)
        assert torch.allclose(a.keys, b.keys[..., :M, :], atol=tol), float((a.keys - b.keys[..., :M, :]).abs().max())
        assert torch.allclose(a.values, b.values[..., :M, :], atol=tol)


@given(seed=st.integers(0, 10_000), n=st.integers(4, 24), d=st.sampled_from([4, 8, 16]), R=st.integers(2, 16),
       spread=st.floats(0.0, 0.5), size=st.integers(2, 4), qscale=st.floats(0.1, 3.0))
@settings(CORE_SETTINGS, max_examples=25)
def test_fitted_attention_on_its_reference_queries_is_never_worse_than_the_mean(seed, n, d, R, spread, size,
                                                                               qscale):
    """Against the expanded cache (every token a copy), on the reference queries, for random
    clusters, sizes and query scales: the fitted state's relative output error is at most the
    mean rule's (2% slack: the fit is least squares in log mass, not in the output itself), and
    clusters of identical keys (spread 0) are exact."""
    g = torch.Generator().manual_seed(seed)
    H = 2
    run = torch.arange(n) // size
    keys = torch.randn(1, H, n, d, generator=g)[:, :, run] + spread * torch.randn(1, H, n, d, generator=g)
    state = KVState.from_raw(keys, torch.randn(1, H, n, d, generator=g))
    state = state.replace(log_sizes=torch.randint(1, 4, (1, H, n), generator=g).float().log(),
                          extras={"reference_queries": qscale * torch.randn(1, 2 * H, R, d, generator=g)})
    q = state.extras["reference_queries"]
    parent = (run * size).expand(1, H, n).clone()
    ek, ev, els = expand_state(state)
    full = proportional_attention(q, ek, ev, els, causal=False)
    fit_err = rel_err(fitted()(state, parent), full, q)
    mean_err = rel_err(apply_merge_plan(state, parent), full, q)
    assert fit_err <= 1.02 * mean_err + 1e-5, (fit_err, mean_err)
    if spread == 0.0:
        assert fit_err < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["huge", "tiny-spread", "unseen", "zero-queries", "padding"])
def test_never_nan_or_inf(dtype, case):
    state, parent = clustered_state(5, N=48)
    keys, q = state.keys, state.extras["reference_queries"]
    mask = None
    if case == "huge":
        keys, q = keys * 300, q * 300  # logits ~1e5
    elif case == "tiny-spread":
        keys = keys[..., :1, :].expand_as(keys) + 1e-3 * torch.randn_like(keys)
    elif case == "unseen":
        q = q.clone()
        q[..., :] = 0
        q[..., 0] = 1e4  # every query attends to one key direction only
        keys = keys.clone()
        keys[..., 0] = torch.linspace(-3, 3, keys.shape[2])
    elif case == "zero-queries":
        q = torch.zeros_like(q)
    mask = torch.ones(1, 48, dtype=torch.long)
    if case == "padding":
        mask[:, :8] = 0
    base = KVState.from_raw(keys.to(dtype), state.values.to(dtype), attention_mask=mask)
    base = base.replace(extras={"reference_queries": q.to(dtype)})
    plan = torch.where(base.valid, parent, -1)
    if case == "padding":
        plan[..., 8:12] = 8  # a cluster that starts after the padding
    for key, power, share in (("mean", 1.0, 1.0), ("attention", 1.0, 1.0), ("attention", 2.0, 1.0),
                              ("attention", 1.0, 0.25)):
        out = fitted(key=key, power=power, refine_share=share, query_stride=1 if share == 1.0 else 2)(base, plan)
        assert out.keys.dtype == dtype and out.values.dtype == dtype
        assert bool(torch.isfinite(out.keys).all() and torch.isfinite(out.values).all())
        ls = out.log_sizes
        assert bool((torch.isfinite(ls) | (ls == float("-inf"))).all())
        assert torch.equal(out.valid, apply_merge_plan(base, plan).valid)
        o = proportional_attention(q.float(), out.keys.float(), out.values.float(), ls, causal=False)
        assert bool(torch.isfinite(o).all())


def test_unseen_clusters_keep_the_proportional_answer():
    """A cluster no reference query attends to (its share underflows) is not fitted to noise."""
    state, parent = clustered_state(2, N=16, size=4)
    q = torch.zeros_like(state.extras["reference_queries"])
    q[..., 0] = 1e3
    keys = state.keys.clone()
    keys[..., 0] = -1.0
    keys[..., :4, 0] = 1.0  # only the first cluster is ever seen
    state = state.replace(keys=keys, extras={"reference_queries": q})
    fit = fitted()(state, parent)
    mean = apply_merge_plan(state, parent)
    assert torch.allclose(fit.log_sizes[..., 1:], mean.log_sizes[..., 1:])
    assert torch.allclose(fit.values[..., 1:, :], mean.values[..., 1:, :])


def test_missing_queries_name_the_key_and_how_to_enable_them():
    state, parent = clustered_state(0, N=8)
    bare = state.replace(extras={})
    with pytest.raises(ValueError, match="reference_queries.*reference_queries > 0"):
        fitted()(bare, parent)
    with pytest.raises(ValueError, match="'queries'.*query_window"):
        FittedMerger()(bare, parent)
    with pytest.raises(ValueError, match="reconstruction_queries.*reconstruction pass"):
        fitted(queries="reconstruction")(state, parent)
    with pytest.raises(ValueError, match="reconstruction_queries"):
        fitted(queries="both")(state, parent)
    wrong = state.replace(extras={"reference_queries": torch.zeros(1, 3, 4, 16)})
    with pytest.raises(ValueError, match="multiple of 2"):
        fitted()(wrong, parent)


@pytest.mark.parametrize("queries, first", [("both", "reference_queries"),
                                            ("prefill+reconstruction", "reference_queries"),
                                            ("window+reconstruction", "queries")])
def test_query_sources_joined_by_plus_are_concatenated(queries, first):
    state, parent = clustered_state(4)
    q = state.extras["reference_queries"]
    half = q.shape[2] // 2
    split = state.replace(extras={first: q[:, :, :half], "reconstruction_queries": q[:, :, half:]})
    a = fitted(queries=queries, reference_queries=half)(split, parent)
    # the same queries, regrouped per KV head, in the same order
    Hq, D = q.shape[1], q.shape[3]
    grouped = torch.cat([q[:, :, :half].reshape(1, 2, -1, D), q[:, :, half:].reshape(1, 2, -1, D)], 2)
    b = fitted()(state.replace(extras={"reference_queries": grouped.reshape(1, Hq, -1, D)}), parent)
    assert torch.allclose(a.values, b.values, atol=1e-6) and torch.allclose(a.log_sizes, b.log_sizes, atol=1e-6)


def test_window_queries_are_the_last_r_of_the_query_window():
    """queries="window": the cache's query window (extras["queries"], maybe longer than R when
    another strategy asked for more) supplies the last R queries; needs ask for that window."""
    state, parent = clustered_state(4)
    q = state.extras["reference_queries"]
    longer = torch.cat([torch.randn_like(q[:, :, :5]), q], dim=2)  # 5 older queries in front
    merger = fitted(queries="window", reference_queries=q.shape[2])
    assert merger.needs.query_window == q.shape[2] and merger.needs.reference_queries == 0
    a = merger(state.replace(extras={"queries": longer}), parent)
    b = fitted()(state, parent)
    assert torch.equal(a.values, b.values) and torch.equal(a.log_sizes, b.log_sizes)
    with pytest.raises(ValueError, match="queries.*query_window"):
        merger(state, parent)


@pytest.mark.parametrize("params, name", [
    ({"rounds": "twice"}, "rounds"), ({"queries": "question"}, "queries"), ({"queries": "window+window"}, "queries"),
    ({"queries": "window+"}, "queries"), ({"key": "max"}, "key"), ({"power": -1.0}, "power"),
    ({"ridge": -0.5}, "ridge"), ({"reference_queries": 0}, "reference_queries"), ({"scale": 0.0}, "scale"),
    ({"refine_share": 0.0}, "refine_share"), ({"refine_share": 1.5}, "refine_share"),
    ({"query_stride": 0}, "query_stride"), ({"query_stride": 1.5}, "query_stride"),
])
def test_bad_parameters_are_value_errors_naming_them(params, name):
    with pytest.raises(ValueError, match=name):
        MERGERS.create("fitted", params)


def test_cluster_index_matches_the_merge_plan_order():
    parent = torch.tensor([[[0, 0, 2, -1, 2, 5]]])
    assert cluster_index(parent).tolist() == [[[0, 0, 1, -1, 1, 2]]]


def test_input_state_is_not_modified():
    state, parent = clustered_state(1)
    before = [t.clone() for t in (state.keys, state.values, state.log_sizes)]
    fitted(key="attention")(state, parent)
    for a, b in zip(before, (state.keys, state.values, state.log_sizes)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["centroidkv", "semanticache-fixed64", "streamingllm"])
def test_a_pipeline_fitting_into_its_rounds_tensors_leaves_the_callers_state_alone(preset):
    """The pipeline hands the fit its rounds' own tensors (owned=True): the state given to
    compress, and a second compression of it, must not see any of those writes."""
    from conftest import assert_state_unchanged, clone_state
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    state, _ = clustered_state(4, N=128, size=4)
    state = state.replace(counts=state.token_counts())
    snapshot = clone_state(state)
    extras = {k: v.clone() for k, v in state.extras.items()}
    cfg = get_preset(preset, keep_ratio=0.25, sinks=2, recent=8).replace(
        merger={"name": "fitted", "params": {"queries": "prefill"}})
    first, report = Pipeline(cfg).compress(state)
    assert report.budget_met
    assert_state_unchanged(state, snapshot)
    assert all(torch.equal(extras[k], state.extras[k]) for k in extras)
    again, _ = Pipeline(cfg).compress(state)
    for name in ("keys", "values", "log_sizes", "positions"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name


def test_counts_add_up_apart_from_the_fitted_bias():
    state, parent = clustered_state(6, N=32)
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(1, 9, state.log_sizes.shape, generator=g).float()
    state = state.replace(counts=counts)
    out = fitted()(state, parent)
    expected = torch.zeros(1, 2, out.num_slots).index_add_(2, cluster_index(parent)[0, 0], counts)
    assert torch.equal(out.counts, expected)
    assert torch.equal(out.token_counts(), expected)
    # the bias is not log(counts): the fit moved it, and it ignores the counts entirely
    assert not torch.allclose(out.log_sizes, expected.log())
    again = fitted()(state.replace(counts=None), parent)
    assert torch.equal(again.log_sizes, out.log_sizes) and torch.equal(again.values, out.values)
    assert torch.equal(again.counts, torch.full_like(expected, 4.0))  # runs of 4 one-token slots


def test_a_fitted_state_is_refitted_from_its_bias_and_keeps_counting_tokens():
    """Second round on an already fitted state (what a later round or decode-time compression
    does): bias beta counts as exp(beta) copies, token counts keep adding up, nothing explodes."""
    state, parent = clustered_state(8, N=64, size=2)
    first = fitted()(state, parent)
    assert torch.equal(first.counts, torch.full((1, 2, 32), 2.0))
    second_plan = (torch.arange(32) // 2 * 2).expand(1, 2, 32).clone()
    second = fitted()(first, second_plan)
    assert torch.equal(second.counts, torch.full((1, 2, 16), 4.0))
    assert bool(torch.isfinite(second.log_sizes).all())
    # the same as fitting a state that has the first round's biases and no counts at all
    plain = fitted()(first.replace(counts=None), second_plan)
    assert torch.equal(plain.log_sizes, second.log_sizes)
    q = state.extras["reference_queries"]
    full = outputs(state, q)
    assert rel_err(second, full, q) < rel_err(apply_merge_plan(apply_merge_plan(state, parent), second_plan), full, q)


def test_needs_ask_for_the_prefill_reference_queries():
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    assert FittedMerger().needs == Needs(query_window=32)  # the default: the layer's last 32 queries
    assert fitted(reference_queries=32).needs == Needs(reference_queries=32)
    assert fitted(queries="reconstruction").needs == Needs(model_pass=True)
    assert fitted(queries="both", reference_queries=8).needs == Needs(reference_queries=8, model_pass=True)
    assert fitted(queries="window", reference_queries=8).needs == Needs(query_window=8)
    cfg = get_preset("centroidkv").replace(merger={"name": "fitted", "params": {"queries": "prefill", "reference_queries": 16}})
    assert Pipeline(cfg).needs.reference_queries == 16


@pytest.mark.parametrize("clusterer", ["csm", "gsc"])
def test_works_in_a_pipeline_with_any_clusterer(clusterer):
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    state, _ = clustered_state(9, N=128, size=4)
    preset = {"csm": "centroidkv", "gsc": "semanticache-fixed64"}[clusterer]
    cfg = get_preset(preset, keep_ratio=0.25, sinks=2, recent=8).replace(
        merger={"name": "fitted", "params": {"queries": "prefill"}})
    out, report = Pipeline(cfg).compress(state)
    # with counts set, the mean merger sums them exactly (else it keeps only log(count))
    mean, _ = Pipeline(get_preset(preset, keep_ratio=0.25, sinks=2, recent=8)).compress(
        state.replace(counts=state.token_counts()))
    assert report.budget_met and out.valid.sum(-1).tolist() == mean.valid.sum(-1).tolist()
    # the rounds merge as the mean merger does (the fit runs once, after them): the same plan
    assert torch.equal(out.positions, mean.positions) and torch.equal(out.token_counts(), mean.token_counts())
    assert torch.equal(out.token_counts().sum(-1), torch.full((1, 2), 128.0))
    q = state.extras["reference_queries"]
    full = outputs(state, q)
    assert rel_err(out, full, q) < rel_err(mean, full, q)


# ---------------------------------------------------------------------------- fit once, after the rounds
def reference_composition(plans: list[torch.Tensor]) -> torch.Tensor:
    """The rounds' plans composed with plain loops: follow each input slot round by round to the
    slot it ends in, and name that slot by the input slot whose chain of representatives it is."""
    B, H, N = plans[0].shape
    out = torch.full((B, H, N), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            behind = list(range(N))  # input slot behind each slot of the current state
            where = list(range(N))  # current slot of each input slot (None: dropped)
            for plan in plans:
                p = plan[b, h].tolist()
                reps = [j for j in range(len(p)) if p[j] == j]
                new_index = {j: i for i, j in enumerate(reps)}
                where = [None if w is None or p[w] < 0 else new_index[p[w]] for w in where]
                behind = [behind[j] for j in reps]
            for n in range(N):
                if where[n] is not None:
                    out[b, h, n] = behind[where[n]]
    return out


class RecordingFit:
    """A FitsComposedPlan merger that records what the pipeline hands it, then fits as ``inner``."""

    def __init__(self, inner: FittedMerger):
        self.inner, self.rounds, self.composed = inner, [], None

    @property
    def round_merger(self):
        def merge(state, parent):
            self.rounds.append(parent.clone())
            return self.inner.round_merger(state, parent)
        return merge

    def fit_plan(self, state, parent, merged, *, owned=False):
        self.composed = parent.clone()
        return self.inner.fit_plan(state, parent, merged, owned=owned)


def test_the_merger_is_declared_to_fit_once():
    from kvcompress.protocols import FitsComposedPlan, Merger

    assert isinstance(FittedMerger(), FitsComposedPlan) and isinstance(FittedMerger().round_merger, Merger)
    assert not isinstance(MERGERS.create("mean", {}), FitsComposedPlan)


@given(seed=st.integers(0, 10_000), rounds=st.integers(1, 4), drop=st.booleans())
@CORE_SETTINGS
def test_composed_plans_equal_the_rounds(seed, rounds, drop):
    """Random multi-round plans (merges into any later or earlier representative, drops, heads of
    different lengths): the composed plan equals the loop reference and, applied once, gives the
    rounds' positions, protection, counts and stats exactly, their keys and values up to rounding."""
    from kvcompress.pipeline import compose_plans

    g = torch.Generator().manual_seed(seed)
    B, H, N, D = 2, 2, 20, 4
    state = KVState.from_raw(torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g))
    state = state.replace(protected=torch.rand(B, H, N, generator=g) < 0.2,
                          stats={"attn_acc": torch.rand(B, H, N, generator=g)})
    current, plans, composed = state, [], None
    for _ in range(rounds):
        n = current.num_slots
        reps = torch.rand(B, H, n, generator=g) < 0.5
        reps[..., 0] = True  # padding comes last: slot 0 is valid
        reps &= current.valid
        idx = torch.arange(n).expand(B, H, n)
        rep_ids = torch.where(reps, idx, n)
        # each non-representative merges into a random representative of its head
        pick = torch.randint(0, n, (B, H, n), generator=g)
        target = torch.where(reps.gather(-1, pick), pick, rep_ids.amin(-1, keepdim=True).expand(B, H, n))
        parent = torch.where(reps, idx, target)
        if drop:
            parent = torch.where(~reps & (torch.rand(B, H, n, generator=g) < 0.3), -1, parent)
        parent = torch.where(current.valid, parent, -1)
        plans.append(parent)
        current = apply_merge_plan(current.replace(counts=current.token_counts()), parent)
        composed = parent if composed is None else compose_plans(composed, parent)
    assert torch.equal(composed, reference_composition(plans))
    once = apply_merge_plan(state.replace(counts=state.token_counts()), composed)
    assert once.num_slots == current.num_slots
    for name in ("positions", "protected", "counts", "valid"):
        assert torch.equal(getattr(once, name), getattr(current, name)), name
    assert torch.allclose(once.stats["attn_acc"], current.stats["attn_acc"], atol=1e-6)
    ok = current.valid[..., None]
    assert torch.allclose(once.keys * ok, current.keys * ok, atol=1e-5)
    assert torch.allclose(once.values * ok, current.values * ok, atol=1e-5)


@pytest.mark.parametrize("preset, min_rounds", [("centroidkv", 2), ("semanticache-fixed64", 1)])
def test_a_pipeline_fits_once_on_the_composed_plan_against_the_original_members(preset, min_rounds):
    """The pipeline's rounds merge as the mean merger's (same plan, same bookkeeping), and the
    result is the fit of the loop-composed plan against the input slots."""
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    state, _ = clustered_state(11, N=160, size=4)
    state = state.replace(stats={"attn_acc": torch.rand(state.log_sizes.shape, generator=torch.Generator().manual_seed(1))})
    base = get_preset(preset, keep_ratio=0.25, sinks=2, recent=8)
    mean, _ = Pipeline(base).compress(state.replace(counts=state.token_counts()))
    pipe = Pipeline(base.replace(merger={"name": "fitted", "params": {"queries": "prefill"}}))
    recorder = RecordingFit(pipe.merger)
    pipe.merger = recorder
    out, report = pipe.compress(state)
    assert report.rounds == len(recorder.rounds) >= min_rounds  # CSM: several rounds, one fit
    composed = reference_composition(recorder.rounds)
    assert torch.equal(recorder.composed, composed)
    for name in ("positions", "valid"):
        assert torch.equal(getattr(out, name), getattr(mean, name)), name
    assert torch.equal(out.token_counts(), mean.token_counts())
    assert torch.allclose(out.stats["attn_acc"], mean.stats["attn_acc"], atol=1e-5)
    direct = FittedMerger(queries="prefill")(state, composed)  # one fit of the composed plan
    assert torch.equal(direct.positions, out.positions) and torch.equal(direct.counts, out.counts)
    for a, b in ((out.keys, direct.keys), (out.values, direct.values), (out.log_sizes, direct.log_sizes)):
        ok = torch.isfinite(b)
        assert torch.equal(ok, torch.isfinite(a)) and torch.allclose(a[ok], b[ok], atol=1e-4)
    # fitted against the original members, it is closer to the full attention than the mean
    q = state.extras["reference_queries"]
    full = outputs(state, q)
    assert rel_err(out, full, q) < 0.7 * rel_err(mean, full, q)


def test_fitting_once_is_no_worse_than_refitting_every_round():
    """The slow reference (a fit after every round, each against the previous round's fitted
    slots) and the single fit against the original members, on the rounds' own plans."""
    state, _ = clustered_state(12, N=160, size=4)
    q = state.extras["reference_queries"]
    full = outputs(state, q)
    merger = FittedMerger(queries="prefill")
    g = torch.Generator().manual_seed(5)
    per_round, plans = state, []
    for _ in range(3):  # three rounds merging random neighbour pairs
        n = per_round.num_slots
        pair = (torch.rand(n // 2, generator=g) < 0.7).repeat_interleave(2)
        pair = torch.cat([pair, torch.zeros(n - pair.numel(), dtype=torch.bool)])
        idx = torch.arange(n)
        parent = torch.where(pair & (idx % 2 == 1), idx - 1, idx).expand(1, 2, n).clone()
        plans.append(parent)
        per_round = merger(per_round, parent)
    once = merger(state, reference_composition(plans))
    assert torch.equal(once.positions, per_round.positions) and torch.equal(once.counts, per_round.counts)
    assert rel_err(once, full, q) <= rel_err(per_round, full, q) * 1.05


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_clusters_seen_only_faintly_are_still_fitted_finitely(power):
    """A cluster whose share of every row is ~1e-20 (seen, far above the unseen floor): its
    weights' squares would underflow float32; the fit stays finite and still moves the slot."""
    state, parent = clustered_state(13, N=32, size=4)
    bias = state.log_sizes.clone()
    bias[..., 4:8] = -60.0  # shares ~1e-26 of every row: squares below float32's range
    state = state.replace(log_sizes=bias)
    q = state.extras["reference_queries"]
    share = torch.softmax(torch.einsum("bhnd,bhpd->bhnp", state.keys, q.reshape(1, 2, -1, 16)) / 4
                          + bias[..., None], 2)[..., 4:8, :].sum(2)
    assert 1e-32 < float(share.min()) and float(share.max()) < 1e-20
    out = fitted(power=power)(state, parent)
    for x in (out.keys, out.values, out.log_sizes):
        assert bool(torch.isfinite(x).all())
    mean = apply_merge_plan(state, parent)
    assert not torch.equal(out.log_sizes[..., 1], mean.log_sizes[..., 1])  # fitted, not left alone


def test_rounds_each_fits_after_every_round_and_leaves_the_last_state_alone():
    """rounds="each" (the slow reference): the pipeline merges with the fitted merger itself every
    round, so the result is the rounds' fitted merges applied one after the other."""
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    each = FittedMerger(queries="prefill", rounds="each")
    assert each.round_merger is each
    state, _ = clustered_state(14, N=160, size=4)
    cfg = get_preset("centroidkv", keep_ratio=0.25, sinks=2, recent=8).replace(
        merger={"name": "fitted", "params": {"queries": "prefill", "rounds": "each"}})
    pipe = Pipeline(cfg)
    out, report = pipe.compress(state)
    assert report.rounds >= 2
    # replay: the same clusterer on the fitted rounds' states
    current = state
    for r in range(report.rounds):
        chunks = pipe.chunking(current, None, report.target)
        plan = pipe.clusterer(current, chunks.chunk_ids, report.target, r).parent
        plan = torch.where(current.valid, plan, -1)
        current = each(current, plan)
    assert torch.equal(current.positions, out.positions) and torch.equal(current.counts, out.counts)
    assert torch.allclose(current.keys, out.keys) and torch.allclose(current.values, out.values)
    assert torch.equal(each.fit_plan(state, torch.zeros(1, 2, 160, dtype=torch.long), out).keys, out.keys)


def test_each_plus_once_refits_the_fitted_rounds_against_the_original_members():
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    state, _ = clustered_state(15, N=160, size=4)
    base = get_preset("centroidkv", keep_ratio=0.25, sinks=2, recent=8)

    def run(rounds):
        cfg = base.replace(merger={"name": "fitted", "params": {"queries": "prefill", "rounds": rounds}})
        return Pipeline(cfg).compress(state)[0]

    each, both = run("each"), run("each+once")
    assert FittedMerger(rounds="each+once").round_merger == FittedMerger(rounds="each")
    # the same rounds (the same plan and bookkeeping), the slots refitted against the members
    assert torch.equal(each.positions, both.positions) and torch.equal(each.counts, both.counts)
    assert not torch.equal(each.log_sizes, both.log_sizes)
    q = state.extras["reference_queries"]
    full = outputs(state, q)
    assert rel_err(both, full, q) <= rel_err(each, full, q) * 1.05


def test_presets_fit_once_to_their_query_window():
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    names = ("centroidkv-fitted", "semanticache-fitted", "semanticache-safe-fitted", "centroidkv-safe-fitted",
             "kvzip-csm-fitted")
    params = {n: dict(get_preset(n).merger.params) for n in names}
    assert {n: (p["rounds"], p["queries"]) for n, p in params.items()} == {n: ("once", "window") for n in names}
    # the steps move the most-attended quarter of the fitted slots (the cost target; session 10), the
    # rest of the merger at its defaults
    assert {n: p["refine_share"] for n, p in params.items()} == {n: 0.25 for n in names}
    assert all(FittedMerger(**p).refine == 3 for p in params.values())
    assert {n: p["reference_queries"] for n, p in params.items()} == {
        "centroidkv-fitted": 32, "semanticache-fitted": 32, "semanticache-safe-fitted": 32, "centroidkv-safe-fitted": 64,
        "kvzip-csm-fitted": 32}
    # the -safe guard reads every captured query: it sees the 64 the fit uses (its twin:
    # centroidkv-safe with query_window=64), and the pipeline asks the cache for exactly those
    cfg = get_preset("centroidkv-safe-fitted")
    assert cfg.query_window == 64 and Pipeline(cfg).needs.query_window == 64
    assert Pipeline(get_preset("kvzip-csm-fitted")).needs.query_window == 32


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_moving_a_share_of_the_slots_never_raises_the_closed_forms_error(share):
    """refine_share < 1: the steps move only the most-attended share of the fitted slots; the
    others keep the closed form bit for bit, and the error on the reference queries is never above
    the closed form's (and below it in every case here)."""
    for seed in range(4):
        state, parent = clustered_state(seed, G=2, size=4, spread=0.4)
        q = state.extras["reference_queries"]
        full = outputs(state, q)
        closed, part = fitted(refine=0)(state, parent), fitted(refine_share=share)(state, parent)
        assert rel_err(part, full, q) < rel_err(closed, full, q)
        assert torch.equal(part.log_sizes, closed.log_sizes)  # the steps move keys and values only
        moved = (part.keys != closed.keys).any(-1)  # [B, H, M]
        assert int(moved.sum(-1).max()) <= math.ceil(share * closed.num_slots)
        # the slots that moved are the most attended under the closed form
        s = torch.einsum("bhgrd,bhmd->bhmgr", q.view(1, 2, 2, -1, q.shape[-1]), closed.keys) / q.shape[-1] ** 0.5
        att = (s + closed.log_sizes[..., None, None]).softmax(2).sum((-2, -1))  # [B, H, M]
        for h in range(2):
            if bool(moved[0, h].any()) and bool((~moved[0, h]).any()):
                assert float(att[0, h][moved[0, h]].min()) >= float(att[0, h][~moved[0, h]].max()) - 1e-6


def test_a_share_of_one_is_the_full_refinement_bit_for_bit():
    state, parent = clustered_state(2, G=2)
    a, b = fitted()(state, parent), fitted(refine_share=1.0)(state, parent)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.log_sizes, b.log_sizes)


def test_split_moving_folds_the_slots_that_stay_into_the_rows():
    """The rows' part of the staying slots plus the moving ones gives the full rows' softmax output
    (float64 reference)."""
    from kvcompress.strategies.fitting import _attention, _scaled_t, row_part, split_moving
    g = torch.Generator().manual_seed(0)
    B, H, K, S, P, D = 1, 2, 10, 6, 7, 8
    keys, values = torch.randn(B, H, K, D, generator=g), torch.randn(B, H, K, D, generator=g)
    bias = torch.randn(B, H, K, generator=g)
    bias[0, 1, -2:] = float("-inf")  # empty rows
    ks, vs, bs = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, generator=g)
    q = 3 * torch.randn(B, H, P, D, generator=g)
    scale = D ** -0.5
    moving, part = split_moving(keys, values, bias, row_part(ks, vs, bs, q, scale), q, scale=scale, share=0.3)
    assert moving.shape == (B, H, 3)
    take = moving[..., None].expand(-1, -1, -1, D)
    _, out = _attention(keys.gather(2, take), values.gather(2, take), bias.gather(2, moving), _scaled_t(q, scale), part)
    allk, allv = torch.cat([keys, ks], 2).double(), torch.cat([values, vs], 2).double()
    w = (torch.einsum("bhpd,bhnd->bhpn", q.double(), allk) * scale + torch.cat([bias, bs], 2).double()[:, :, None]).softmax(-1)
    assert torch.allclose(out.double(), w @ allv, atol=1e-5)


def test_query_stride_reads_every_stride_th_query_the_last_included():
    state, parent = clustered_state(4, R=24)
    q = state.extras["reference_queries"]
    a = fitted(query_stride=3)(state, parent)
    b = fitted()(state.replace(extras={"reference_queries": q[:, :, 2::3]}), parent)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.log_sizes, b.log_sizes)
