"""Scorers of the baselines against plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress import SCORERS, KVState
from kvcompress.strategies.mergers import apply_merge_plan
from kvcompress.strategies.scorers import window_attention


def make_state(B=2, H=2, N=12, D=4, pad=(0, 3), seed=0, dup_pairs=False) -> KVState:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g)
    if dup_pairs:  # slot 2i+1 repeats slot 2i
        keys[:, :, 1::2] = keys[:, :, 0::2]
    values = torch.randn(B, H, N, D, generator=g)
    mask = torch.ones(B, N)
    for b, p in enumerate(pad[:B]):
        mask[b, :p] = 0
    return KVState.from_raw(keys, values, attention_mask=mask)


def ref_window_attention(state: KVState, q: torch.Tensor, proportional=True, scale=None) -> torch.Tensor:
    B, H, N, D = state.keys.shape
    Hq, W = q.shape[1], q.shape[2]
    G = Hq // H
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, H, N, dtype=torch.float64)
    start = state.start()
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            for w in range(W):
                qpos = state.num_tokens - W + w
                if qpos < int(start[b]):
                    continue
                logits = {}
                for n in range(N):
                    ls = float(state.log_sizes[b, h, n])
                    if ls == float("-inf") or int(state.positions[b, h, n]) > qpos:
                        continue
                    dot = sum(float(q[b, hq, w, d]) * float(state.keys[b, h, n, d]) for d in range(D))
                    logits[n] = dot * scale + (ls if proportional else 0.0)
                z = max(logits.values())
                tot = sum(math.exp(x - z) for x in logits.values())
                for n, x in logits.items():
                    out[b, h, n] += math.exp(x - z) / tot
    return out


def ref_pool(x: list[float], k: int, pooling: str) -> list[float]:
    p = k // 2
    out = []
    for n in range(len(x)):
        win = [x[j] if 0 <= j < len(x) else 0.0 for j in range(n - p, n + p + 1)]
        out.append(max(win) if pooling == "max" else sum(win) / k)
    return out


@pytest.mark.parametrize("proportional", [True, False])
def test_window_attention_matches_loops(proportional):
    state = make_state()
    # a merged state, so log-sizes and representative positions matter
    parent = torch.arange(12).expand(2, 2, 12).clone()
    parent[:, :, 5] = 4
    parent[:, 0, 7] = 6
    parent[1, :, :3] = -1  # left padding
    state = apply_merge_plan(state, parent)
    q = torch.randn(2, 4, 3, 4, generator=torch.Generator().manual_seed(1))
    got = window_attention(state, q, proportional=proportional)
    ref = ref_window_attention(state, q, proportional=proportional)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling,kernel", [("max", 3), ("avg", 5), ("max", 1)])
def test_snapkv_matches_loops(pooling, kernel):
    state = make_state(N=14)
    q = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    state = state.replace(extras={"queries": q})
    got = SCORERS.create("snapkv", {"kernel_size": kernel, "pooling": pooling})(state)
    attn = ref_window_attention(state, q)
    T, W = state.num_tokens, 4
    for b in range(2):
        for h in range(2):
            in_win = [bool(state.valid[b, h, n]) and int(state.positions[b, h, n]) >= T - W for n in range(14)]
            x = [0.0 if (in_win[n] or not bool(state.valid[b, h, n])) else float(attn[b, h, n]) for n in range(14)]
            pooled = ref_pool(x, kernel, pooling)
            for n in range(14):
                if in_win[n]:
                    assert got[b, h, n] == float("inf")
                else:
                    assert abs(float(got[b, h, n]) - pooled[n]) < 1e-5


@pytest.mark.parametrize("proportional", [True, False])
def test_attention_scorer_matches_loops(proportional):
    state = make_state(N=10)
    q = torch.randn(2, 4, 3, 4, generator=torch.Generator().manual_seed(4))
    got = SCORERS.create("attention", {"proportional": proportional})(state.replace(extras={"queries": q}))
    torch.testing.assert_close(got.double(), ref_window_attention(state, q, proportional), atol=1e-5, rtol=1e-5)


def test_attention_scorer_mean_divides_by_the_queries_that_see_each_slot():
    state = make_state(N=10)
    q = torch.randn(2, 4, 3, 4, generator=torch.Generator().manual_seed(6))
    got = SCORERS.create("attention", {"reduce": "mean"})(state.replace(extras={"queries": q}))
    total = ref_window_attention(state, q)
    start = state.start()
    for b in range(2):
        for h in range(2):
            for n in range(10):
                pos = int(state.positions[b, h, n])
                seeing = sum(2 for w in range(3) if pos <= 10 - 3 + w and 10 - 3 + w >= int(start[b]))  # G = 2
                expect = float(total[b, h, n]) / max(seeing, 1)
                assert abs(float(got[b, h, n]) - expect) < 1e-5


def test_snapkv_window_field_uses_the_last_queries():
    state = make_state()
    q = torch.randn(2, 4, 6, 4)
    full = SCORERS.create("snapkv", {"window": 2, "kernel_size": 1})(state.replace(extras={"queries": q}))
    last = SCORERS.create("snapkv", {"kernel_size": 1})(state.replace(extras={"queries": q[:, :, -2:]}))
    torch.testing.assert_close(full, last)


def test_window_scores_stay_meaningful_after_merging():
    """With proportional attention, a merged pair of duplicate tokens scores as the pair did."""
    state = make_state(B=1, H=2, N=12, pad=(0,), dup_pairs=True)
    q = torch.randn(1, 2, 2, 4, generator=torch.Generator().manual_seed(3))  # positions 10, 11
    before = window_attention(state, q)
    parent = torch.arange(12).expand(1, 2, 12).clone()
    parent[..., 1:8:2] = parent[..., 0:8:2]  # pairs (0,1) ... (6,7) merge; all visible to both queries
    merged = apply_merge_plan(state, parent)
    after = window_attention(merged, q)
    expect = torch.cat([before[..., 0:8:2] + before[..., 1:8:2], before[..., 8:]], dim=-1)
    torch.testing.assert_close(after, expect, atol=1e-6, rtol=1e-5)
    plain = window_attention(merged, q, proportional=False)
    assert not torch.allclose(plain, expect, atol=1e-3)  # without sizes the scores drift


def test_h2o_uses_accumulated_attention_when_there_is_some():
    state = make_state()
    acc = torch.rand(2, 2, 12)
    acc[1, 0] = 0.0  # this head has accumulated nothing yet: prefill scoring from the window
    q = torch.randn(2, 4, 3, 4)
    got = SCORERS.create("h2o")(state.replace(stats={"attn_acc": acc}, extras={"queries": q}))
    win = ref_window_attention(state, q).float()
    valid = state.valid
    torch.testing.assert_close(got[0], acc[0].masked_fill(~valid[0], 0))
    torch.testing.assert_close(got[1, 1], acc[1, 1].masked_fill(~valid[1, 1], 0))
    torch.testing.assert_close(got[1, 0], win[1, 0], atol=1e-5, rtol=1e-5)


def test_knorm_recency_random():
    state = make_state()
    kn = SCORERS.create("knorm")(state)
    torch.testing.assert_close(kn, -state.keys.norm(dim=-1))
    assert torch.equal(SCORERS.create("recency")(state), state.positions.float())
    r1 = SCORERS.create("random", {"seed": 3})(state)
    r2 = SCORERS.create("random", {"seed": 3})(state)
    r3 = SCORERS.create("random", {"seed": 4})(state)
    assert torch.equal(r1, r2) and not torch.equal(r1, r3)


def test_missing_statistics_are_clear_errors():
    state = make_state()
    with pytest.raises(ValueError, match="query_window"):
        SCORERS.create("snapkv")(state)
    with pytest.raises(ValueError, match="query_window"):
        SCORERS.create("attention")(state)
    with pytest.raises(ValueError, match="track_attention"):
        SCORERS.create("h2o")(state)
    with pytest.raises(ValueError, match="query_window"):  # prefill, nothing accumulated, no queries
        SCORERS.create("h2o")(state.replace(stats={"attn_acc": torch.zeros(2, 2, 12)}))
    with pytest.raises(ValueError, match="query_window"):  # asks for more queries than captured
        SCORERS.create("snapkv", {"window": 8})(state.replace(extras={"queries": torch.randn(2, 4, 4, 4)}))
    with pytest.raises(ValueError, match="queries"):  # wrong head count
        SCORERS.create("snapkv")(state.replace(extras={"queries": torch.randn(2, 3, 4, 4)}))


@pytest.mark.parametrize("name,params", [
    ("snapkv", {"kernel_size": 4}), ("snapkv", {"pooling": "min"}), ("snapkv", {"window": 0}),
    ("h2o", {"scale": -1.0}), ("random", {"seed": -1}), ("snapkv", {"bogus": 1}), ("attention", {"reduce": "max"}),
])
def test_bad_parameters(name, params):
    with pytest.raises(ValueError):
        SCORERS.create(name, params)
