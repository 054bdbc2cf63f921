"""Merging baselines (CaM, D2O) against plain-loop references, and their size bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress import CLUSTERERS, MERGERS, KVState, Pipeline, PipelineConfig, StrategySpec, get_preset
from kvcompress.attention import expand_state, proportional_attention
from kvcompress.decode import append_tokens
from kvcompress.strategies.d2o import TAU_KEY


def make_state(B=2, H=2, N=18, D=4, pad=(0, 3), seed=0, dup_pairs=False, **extras) -> KVState:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g)
    if dup_pairs:
        keys[:, :, 1::2] = keys[:, :, 0::2]
    mask = torch.ones(B, N)
    for b, p in enumerate(pad[:B]):
        mask[b, :p] = 0
    state = KVState.from_raw(keys, torch.randn(B, H, N, D, generator=g), attention_mask=mask)
    stats = {k: extras.pop(k) for k in ("attn_acc",) if k in extras}  # per-slot statistics
    return state.replace(extras=extras, stats=stats)


def ref_keep(state, free, target, scores, share):
    """Per (b, h): the free slots kept (recent share by position first, then best scores)."""
    B, H, N = scores.shape
    keep = {}
    for b in range(B):
        for h in range(H):
            valid = [n for n in range(N) if bool(state.valid[b, h, n])]
            fr = [n for n in valid if bool(free[b, h, n])]
            quota = max(0, int(target[b, h]) - (len(valid) - len(fr)))
            n_recent = math.floor(quota * share + 1e-9)
            recent = sorted(fr, key=lambda n: -int(state.positions[b, h, n]))[:n_recent]
            rest = sorted((n for n in fr if n not in recent), key=lambda n: (-float(scores[b, h, n]), n))
            keep[b, h] = set(recent + rest[: quota - n_recent])
    return keep


def pipeline_parts(pipe, state):
    protected = pipe.protection(state)
    chunk = pipe.chunker(state, protected)
    return chunk, pipe.target_slots(state)


def slots_by_position(out: KVState, b: int, h: int) -> dict[int, int]:
    return {int(out.positions[b, h, m]): m for m in range(out.num_slots) if bool(out.valid[b, h, m])}


# ----------------------------------------------------------------------------------------- CaM
def ref_cam(state, chunk, keep, A, span, rule, threshold, proportional, seed):
    """Expected (kept slots, values, sizes) per (b, h) from loops over slots."""
    B, H, N, D = state.keys.shape
    draw = torch.rand((B, H, N), generator=torch.Generator().manual_seed(seed + state.num_tokens), dtype=torch.float64)
    result = {}
    for b in range(B):
        for h in range(H):
            valid = [n for n in range(N) if bool(state.valid[b, h, n])]
            free = {n for n in valid if int(chunk[b, h, n]) >= 0}
            kept = [n for n in valid if n not in free or n in keep[b, h]]
            receiving = {n for n in kept if n in free}
            values = {n: state.values[b, h, n].double().clone() for n in kept}
            sizes = {n: float(state.log_sizes[b, h, n].exp()) for n in kept}
            recv_mass = {n: 0.0 for n in kept}
            recv_val = {n: torch.zeros(D, dtype=torch.float64) for n in kept}
            for e in sorted(free - set(kept)):
                c = int(chunk[b, h, e])
                ok = lambda k: k in receiving and int(chunk[b, h, k]) == c  # noqa: E731
                after = [k for k in kept if k > e]
                before = [k for k in kept if k < e][::-1]
                side = after if after and ok(after[0]) else before if before and ok(before[0]) else []
                targets = []
                for k in side:
                    if not ok(k) or len(targets) == span:
                        break
                    targets.append(k)
                if not targets:
                    continue
                if rule != "always":
                    mean = sum(float(A[b, h, k]) for k in targets) / len(targets)
                    p = float(A[b, h, e]) / mean if mean > 0 else float(float(A[b, h, e]) > 0)
                    merge = p >= threshold if rule == "threshold" else float(draw[b, h, e]) < min(max(p, 0.0), 1.0)
                    if not merge:
                        continue
                m = len(targets)
                s_e = float(state.log_sizes[b, h, e].exp())
                for k in targets:
                    w = s_e / m if proportional else 1.0 / m
                    recv_mass[k] += w
                    recv_val[k] += w * state.values[b, h, e].double()
            for k in kept:
                if proportional:
                    tot = sizes[k] + recv_mass[k]
                    values[k] = (sizes[k] * values[k] + recv_val[k]) / tot
                    sizes[k] = tot
                else:
                    values[k] = values[k] + recv_val[k]
            result[b, h] = (kept, values, sizes)
    return result


@pytest.mark.parametrize("proportional", [False, True])
@pytest.mark.parametrize("rule,span,chunker,recent", [
    ("always", 3, "global", 0), ("threshold", 2, "global", 2), ("bernoulli", 4, "global", 0),
    ("always", 2, {"name": "fixed", "params": {"size": 4}}, 3), ("bernoulli", 1, {"name": "fixed", "params": {"size": 5}}, 0),
])
def test_cam_matches_loops(proportional, rule, span, chunker, recent):
    acc = torch.rand(2, 2, 18, generator=torch.Generator().manual_seed(5)) + 0.05
    state = make_state(attn_acc=acc)
    cfg = PipelineConfig(keep_ratio=0.4, sinks=2, recent=recent, chunker=chunker, clusterer=StrategySpec("cam", {
        "scorer": "knorm", "recent_share": 0.5, "merge_scorer": "h2o", "span": span, "merge_rule": rule,
        "threshold": 0.8, "seed": 3}), merger=StrategySpec("cam", {"proportional": proportional}))
    pipe = Pipeline(cfg)
    out, report = pipe.compress(state)
    assert report.budget_met
    chunk, target = pipeline_parts(pipe, state)
    free = (chunk >= 0) & state.valid
    keep = ref_keep(state, free, target, -state.keys.norm(dim=-1), 0.5)
    ref = ref_cam(state, chunk, keep, acc.double(), span, rule, 0.8, proportional, 3)
    merged_any = False
    for (b, h), (kept, values, sizes) in ref.items():
        got = slots_by_position(out, b, h)
        assert sorted(got) == kept  # raw state: position == original slot
        for n in kept:
            m = got[n]
            assert torch.equal(out.keys[b, h, m], state.keys[b, h, n])  # keys never change
            torch.testing.assert_close(out.values[b, h, m].double(), values[n], atol=1e-5, rtol=1e-5)
            assert abs(float(out.log_sizes[b, h, m].exp()) - sizes[n]) < 1e-5
            merged_any |= not torch.equal(out.values[b, h, m], state.values[b, h, n])
    assert merged_any  # the case exercised merging at all


def test_cam_bernoulli_is_seeded():
    # queries that spread attention, so that many evicted tokens have 0 < p < 1
    queries = 2.0 * torch.randn(2, 4, 8, 4, generator=torch.Generator().manual_seed(11))
    state = make_state(N=40, pad=(0, 0), queries=queries)
    runs = [Pipeline("cam", keep_ratio=0.3, **{"clusterer.seed": s}).compress(state)[0].values for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_cam_prefill_spreads_into_the_recent_window_only():
    """StreamingLLM-based CaM: sinks untouched, the first `span` window slots absorb the evicted."""
    state = make_state(B=1, H=1, N=20, pad=(0,), attn_acc=torch.ones(1, 1, 20))
    out, _ = Pipeline("cam", max_slots=10, **{"clusterer.span": 3, "clusterer.merge_rule": "always"}).compress(state)
    assert out.positions[0, 0].tolist() == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]
    changed = [not torch.equal(out.values[0, 0, m], state.values[0, 0, p]) for m, p in enumerate(out.positions[0, 0].tolist())]
    assert changed == [False] * 4 + [True] * 3 + [False] * 3
    evicted = state.values[0, 0, 4:14].sum(0)
    torch.testing.assert_close(out.values[0, 0, 4:7].sum(0), state.values[0, 0, 14:17].sum(0) + evicted)


# ----------------------------------------------------------------------------------------- D2O
def ref_d2o(state, chunk, keep, threshold, proportional, prev_tau=None, beta=0.7):
    B, H, N, D = state.keys.shape
    result, taus = {}, {}
    for b in range(B):
        for h in range(H):
            valid = [n for n in range(N) if bool(state.valid[b, h, n])]
            free = {n for n in valid if int(chunk[b, h, n]) >= 0}
            kept = [n for n in valid if n not in free or n in keep[b, h]]
            receiving = [n for n in kept if n in free]
            unit = {n: state.keys[b, h, n].double() / state.keys[b, h, n].double().norm() for n in valid}
            cands = {}
            for e in sorted(free - set(kept)):
                options = [k for k in receiving if int(chunk[b, h, k]) == int(chunk[b, h, e])]
                if options:
                    sims = [float(unit[e] @ unit[k]) for k in options]
                    best = max(range(len(options)), key=lambda i: (sims[i], -i))
                    cands[e] = (options[best], sims[best])
            mean = sum(u for _, u in cands.values()) / len(cands) if cands else float("nan")
            prev = float("nan") if prev_tau is None else float(prev_tau[b, h])
            if math.isnan(prev):
                tau = mean if threshold is None else threshold
            else:
                tau = beta * mean + (1 - beta) * prev if cands else prev
            taus[b, h] = tau
            members = {k: [(k, math.e)] for k in kept}
            for e, (k, u) in cands.items():
                if u >= tau:
                    members[k].append((e, math.exp(u)))
            out = {}
            for k, mem in members.items():
                size = lambda n: float(state.log_sizes[b, h, n].exp())  # noqa: E731
                w = [(n, wt * (size(n) if proportional else 1.0)) for n, wt in mem]
                tot = sum(x for _, x in w)
                key = sum(x * state.keys[b, h, n].double() for n, x in w) / tot
                val = sum(x * state.values[b, h, n].double() for n, x in w) / tot
                s = sum(size(n) for n, _ in mem) if proportional else size(k)
                out[k] = (key, val, s)
            result[b, h] = out
    return result, taus


@pytest.mark.parametrize("proportional", [False, True])
@pytest.mark.parametrize("threshold,chunker,recent", [
    (None, "global", 0), (0.1, "global", 3), (None, {"name": "fixed", "params": {"size": 6}}, 2),
])
def test_d2o_matches_loops(proportional, threshold, chunker, recent):
    state = make_state(N=24, attn_acc=torch.rand(2, 2, 24, generator=torch.Generator().manual_seed(7)))
    cfg = PipelineConfig(keep_ratio=0.5, sinks=1, recent=recent, chunker=chunker,
                         clusterer=StrategySpec("d2o", {"scorer": "h2o", "recent_share": 0.5}),
                         merger=StrategySpec("d2o", {"threshold": threshold, "proportional": proportional}))
    pipe = Pipeline(cfg)
    out, report = pipe.compress(state)
    assert report.budget_met
    chunk, target = pipeline_parts(pipe, state)
    keep = ref_keep(state, (chunk >= 0) & state.valid, target, state.stats["attn_acc"], 0.5)
    ref, taus = ref_d2o(state, chunk, keep, threshold, proportional)
    n_merged = 0
    for (b, h), slots in ref.items():
        got = slots_by_position(out, b, h)
        assert sorted(got) == sorted(slots)
        for n, (key, val, size) in slots.items():
            m = got[n]
            torch.testing.assert_close(out.keys[b, h, m].double(), key, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.values[b, h, m].double(), val, atol=1e-5, rtol=1e-5)
            assert abs(float(out.log_sizes[b, h, m].exp()) - size) < 1e-5
            n_merged += not torch.equal(out.keys[b, h, m], state.keys[b, h, n])
        assert abs(float(out.extras[TAU_KEY][b, h]) - taus[b, h]) < 1e-6
    assert n_merged > 0


def test_d2o_threshold_follows_an_ema_while_decoding():
    state = make_state(N=24, attn_acc=torch.rand(2, 2, 24))
    pipe = Pipeline("d2o", keep_ratio=0.5, query_window=4)
    out, _ = pipe.compress(state)
    tau0 = out.extras[TAU_KEY].clone()
    grown = append_tokens(out.replace(stats={**out.stats, "attn_acc": torch.rand(out.log_sizes.shape)}),
                          torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4))
    again, report = pipe.compress(grown)
    assert report.budget_met
    chunk, target = pipeline_parts(pipe, grown)
    keep = ref_keep(grown, (chunk >= 0) & grown.valid, target, grown.stats["attn_acc"], 0.5)
    _, taus = ref_d2o(grown, chunk, keep, None, False, prev_tau=tau0, beta=0.7)
    for (b, h), tau in taus.items():
        assert abs(float(again.extras[TAU_KEY][b, h]) - tau) < 1e-6
    assert not torch.allclose(again.extras[TAU_KEY], tau0)


# ------------------------------------------------------------------- sizes and proportional attention
def attention_of(state: KVState, q: torch.Tensor, use_sizes=True) -> torch.Tensor:
    return proportional_attention(q, state.keys, state.values, state.log_sizes, causal=False, use_sizes=use_sizes)


@pytest.mark.parametrize("merger", [("cam", {"proportional": True}), ("d2o", {"threshold": 0.5, "proportional": True})])
def test_merging_duplicates_is_lossless_with_sizes(merger):
    """Slot 2i+1 repeats slot 2i's key; merging some pairs keeps attention exact only with sizes."""
    state = make_state(dup_pairs=True, pad=(0, 0))
    parent = torch.arange(18).expand(2, 2, 18).clone()
    parent[..., 1:8:2] = parent[..., 0:8:2]  # pairs (0, 1) .. (6, 7) merge, the rest stay
    q = torch.randn(2, 4, 3, 4)
    name, params = merger
    merged = MERGERS.create(name, params)(state, parent)
    assert merged.num_slots == 14
    assert torch.equal(merged.sizes()[0, 0], torch.tensor([2.0] * 4 + [1.0] * 10))
    torch.testing.assert_close(attention_of(merged, q), attention_of(state, q))
    ek, ev, els = expand_state(merged)  # attention over the merged state == over its expanded cache
    torch.testing.assert_close(attention_of(merged, q), proportional_attention(q, ek, ev, els, causal=False))
    original = MERGERS.create(name, {**params, "proportional": False})(state, parent)
    assert not torch.allclose(attention_of(original, q, use_sizes=False), attention_of(state, q), atol=1e-4)


@pytest.mark.parametrize("preset", ["cam-prop", "d2o-prop"])
def test_sizes_account_for_every_absorbed_token(preset):
    state = make_state(N=30, attn_acc=torch.rand(2, 2, 30) + 0.1, queries=torch.randn(2, 4, 8, 4))
    overrides = {"clusterer.span": 1} if preset == "cam-prop" else {}
    pipe = Pipeline(preset, keep_ratio=0.3, **overrides)
    out, _ = pipe.compress(state)
    eviction = Pipeline(get_preset(preset, keep_ratio=0.3).replace(merger="mean", clusterer=StrategySpec(
        "evict", {k: v for k, v in pipe.config.clusterer.params.items() if k in ("scorer", "recent_share")})))
    dropped = state.valid.sum(-1) - eviction.compress(state)[0].valid.sum(-1)
    total = out.sizes().sum(-1)
    absorbed = total - out.valid.sum(-1)
    assert (absorbed > 0).any() and (absorbed <= dropped + 1e-4).all()
    torch.testing.assert_close(out.sizes(), out.sizes().round(), atol=1e-5, rtol=0)  # whole tokens with span 1
    q = torch.randn(2, 4, 2, 4)
    ek, ev, els = expand_state(out)
    torch.testing.assert_close(attention_of(out, q), proportional_attention(q, ek, ev, els, causal=False))


def test_original_methods_leave_sizes_alone():
    state = make_state(N=30, attn_acc=torch.rand(2, 2, 30) + 0.1, queries=torch.randn(2, 4, 8, 4))
    for preset in ("cam", "d2o"):
        out, _ = Pipeline(preset, keep_ratio=0.3).compress(state)
        assert torch.equal(out.log_sizes[out.valid], torch.zeros(int(out.valid.sum())))


@pytest.mark.parametrize("preset", ["cam", "cam-prop", "d2o", "d2o-prop"])
def test_recompress_after_decoding(preset):
    state = make_state(N=24, queries=torch.randn(2, 4, 4, 4), attn_acc=torch.zeros(2, 2, 24))
    pipe = Pipeline(preset, keep_ratio=0.5, query_window=4)
    out, _ = pipe.compress(state)
    acc = torch.rand(out.log_sizes.shape).masked_fill(~out.valid, 0)
    grown = append_tokens(out.replace(stats={**out.stats, "attn_acc": acc}),
                          torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4))
    again, report = pipe.compress(grown)
    assert report.budget_met and torch.equal(again.valid.sum(-1), pipe.target_slots(grown))
    if preset.endswith("prop"):  # sizes never exceed the tokens seen
        assert (again.sizes().sum(-1) <= grown.real_tokens()[:, None] + 1e-4).all()


def test_merge_statistics_missing_is_a_clear_error():
    with pytest.raises(ValueError, match="query_window"):
        Pipeline("cam", keep_ratio=0.5).compress(make_state())
    with pytest.raises(ValueError, match="track_attention"):
        Pipeline("d2o", keep_ratio=0.5).compress(make_state())


@pytest.mark.parametrize("kind,name,params", [
    ("clusterer", "cam", {"span": 0}), ("clusterer", "cam", {"merge_rule": "sometimes"}),
    ("clusterer", "cam", {"threshold": -1}), ("clusterer", "d2o", {"recent_share": -0.1}),
    ("merger", "d2o", {"threshold": 2.0}), ("merger", "d2o", {"beta": 1.5}), ("merger", "cam", {"proportional": 1}),
])
def test_bad_parameters(kind, name, params):
    registry = CLUSTERERS if kind == "clusterer" else MERGERS
    with pytest.raises(ValueError):
        registry.create(name, params)
