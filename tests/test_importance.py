"""Reconstruction scorer, Ada-KV per-head budgets, importance guard, kvzip presets (pure torch)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies.importance import (
    ImportanceGuard, ReconstructionScorer, adaptive_keep, token_importance,
)

VOCAB = ("a", " b", " c", ".", " d", " e", "!", " f")


def with_scores(state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    score = torch.rand(state.log_sizes.shape, generator=gen)
    return state.replace(stats={**state.stats, "reconstruction": score}), score


def test_scorer_reads_statistic_and_errors_without_model_pass():
    state = make_state(0, with_membership=False)
    with pytest.raises(ValueError, match="reconstruction"):
        ReconstructionScorer()(state)
    scored, score = with_scores(state)
    assert torch.equal(ReconstructionScorer()(scored), score)
    bad = state.replace(stats={"reconstruction": torch.zeros(1, 1, 1)})
    with pytest.raises(ValueError, match="reconstruction"):  # carried data is not the statistic
        ReconstructionScorer()(state.replace(extras={"reconstruction": score}))
    with pytest.raises(ValueError, match="shape"):
        ReconstructionScorer()(bad)


def reference_adaptive(scores, free, quota, floor_share):
    """Slow Ada-KV: per head its floor best first, then the layer's remaining budget to the best
    remaining candidates of any head (ties to the lower head*N + slot index)."""
    B, H, N = scores.shape
    keep = torch.zeros(B, H, N, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            floor = int(quota[b, h] * floor_share + 1e-9)
            cand = sorted([n for n in range(N) if free[b, h, n]], key=lambda n: (-float(scores[b, h, n]), n))
            for n in cand[:floor]:
                keep[b, h, n] = True
        left = int(quota[b].sum()) - int(keep[b].sum())
        rest = [(h, n) for h in range(H) for n in range(N) if free[b, h, n] and not keep[b, h, n]]
        rest.sort(key=lambda hn: (-float(scores[b, hn[0], hn[1]]), hn[0] * N + hn[1]))
        for h, n in rest[:max(left, 0)]:
            keep[b, h, n] = True
    return keep


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), floor=st.sampled_from([0.0, 0.2, 0.5, 1.0]))
def test_adaptive_budgets_sum_to_layer_budget(seed, floor):
    gen = torch.Generator().manual_seed(seed)
    B, H, N = 2, 3, 12
    scores = torch.rand(B, H, N, generator=gen)
    free = torch.rand(B, H, N, generator=gen) < 0.8
    quota = torch.randint(0, 6, (B, H), generator=gen)
    keep = adaptive_keep(scores, free, quota, floor)
    assert not bool((keep & ~free).any())
    expected = torch.minimum(quota.sum(-1), free.sum(dim=(1, 2)))
    assert torch.equal(keep.sum(dim=(1, 2)), expected)
    assert torch.equal(keep, reference_adaptive(scores, free, quota, floor))


def reference_rectangular(scores, free, quota, floor_share):
    """Slow rectangular Ada-KV: floors first, then candidates of any head best first (a head only
    while under its quota) until the first head reaches its quota; ties with that score go too."""
    B, H, N = scores.shape
    keep = torch.zeros(B, H, N, dtype=torch.bool)
    for b in range(B):
        need = []
        for h in range(H):
            floor = int(quota[b, h] * floor_share + 1e-9)
            cand = sorted([n for n in range(N) if free[b, h, n]], key=lambda n: (-float(scores[b, h, n]), n))
            for n in cand[:floor]:
                keep[b, h, n] = True
            need.append(max(int(quota[b, h]) - floor, 0))
        rest = [(h, n) for h in range(H) for n in range(N) if free[b, h, n] and not keep[b, h, n]]
        rest.sort(key=lambda hn: (-float(scores[b, hn[0], hn[1]]), hn[1]))
        count, thr = [0] * H, None
        for h, n in rest:
            s = float(scores[b, h, n])
            if thr is not None and s < thr:
                break
            if count[h] < need[h]:
                keep[b, h, n] = True
                count[h] += 1
                if count[h] == need[h] and thr is None:
                    thr = s
    return keep


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), floor=st.sampled_from([0.0, 0.2, 0.5, 1.0]), ties=st.booleans())
def test_rectangular_adaptive_keeps_every_head_within_its_quota(seed, floor, ties):
    gen = torch.Generator().manual_seed(seed)
    B, H, N = 2, 3, 12
    scores = torch.rand(B, H, N, generator=gen)
    if ties:
        scores = (scores * 4).round() / 4
    free = torch.rand(B, H, N, generator=gen) < 0.8
    quota = torch.randint(0, 6, (B, H), generator=gen)
    keep = adaptive_keep(scores, free, quota, floor, rectangular=True)
    assert not bool((keep & ~free).any())
    assert bool((keep.sum(-1) <= quota).all())  # the padded tensor is the uniform budget
    assert torch.equal(keep, reference_rectangular(scores, free, quota, floor))
    # a head keeps a best-first prefix of its candidates: what uniform selection keeps, or less
    from kvcompress.strategies.eviction import rank_desc

    uniform = free & (rank_desc(scores, free) < quota[..., None])
    assert not bool((keep & ~uniform).any()) or ties


def test_kvzip_presets_meet_budgets():
    state, _ = with_scores(make_state(3, B=2, H=3, N=256, vocab=VOCAB, with_membership=False))
    for name in ("kvzip", "kvzip-adakv", "kvzip-sentences", "kvzip-gsc", "kvzip-csm", "kvzip-csm-tokens"):
        pipe = Pipeline(get_preset(name, keep_ratio=0.25, on_infeasible="error"))
        out, report = pipe.compress(state, layer_idx=0)
        assert report.budget_met, name
        slots = out.valid.sum(-1)
        if name == "kvzip-adakv":  # per-head counts vary, none above the budget, one head at it
            assert bool((slots <= 64).all()) and bool((slots.amax(-1) == 64).all()), slots
        elif name.startswith("kvzip"):
            assert bool((slots == 64).all()), (name, slots)
        else:
            assert bool((slots <= 64).all()), (name, slots)


def test_kvzip_keeps_the_top_scored_slots():
    state, score = with_scores(make_state(4, B=1, H=2, N=40, with_membership=False))
    pipe = Pipeline(get_preset("kvzip", keep_ratio=0.25, sinks=0))
    out, _ = pipe.compress(state)
    for h in range(2):
        top = set(score[0, h].topk(10).indices.tolist())
        assert set(out.positions[0, h][out.valid[0, h]].tolist()) == top


def test_importance_guard_picks_best_sentences_in_every_head():
    # 4 sentences of 4 tokens: ". " ends them; sentence 2 carries the importance
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 3, 0, 2, 5, 3, 4, 1, 2, 3]])
    N = ids.shape[1]
    states = []
    for layer in range(3):
        keys = torch.randn(1, 2, N, 4)
        st_ = make_state(layer, B=1, H=2, N=N, D=4, vocab=VOCAB, with_membership=False)
        score = torch.full((1, 2, N), 0.01)
        score[:, layer % 2, 8:12] = 0.5  # one head per layer, same sentence
        states.append(st_.replace(keys=keys, token_ids=ids, stats={"reconstruction": score}))
    guard = ImportanceGuard(share=0.5)
    already = torch.zeros(1, N, dtype=torch.bool)
    guard.prepare(states, torch.tensor([8]), already)
    chosen = guard.chosen_tokens()[0].nonzero().flatten().tolist()
    assert chosen[:4] == [8, 9, 10, 11] and len(chosen) <= 4
    mask = guard(states[1])
    assert bool(mask[0, :, 8:12].all()) and int(mask.sum()) == 8
    imp = token_importance(states, N)
    torch.testing.assert_close(imp[0, 8], torch.tensor(0.5 * 3 + 0.01 * 3))


def test_guard_needs_reconstruction_and_bad_params():
    state = make_state(0, B=1, N=16, vocab=VOCAB, with_membership=False)
    with pytest.raises(ValueError, match="reconstruction"):
        ImportanceGuard().prepare([state], torch.tensor([4]), torch.zeros(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="share"):
        ImportanceGuard(share=1.5)
    with pytest.raises(ValueError, match="reduce"):
        ImportanceGuard(reduce="middle")
    with pytest.raises(ValueError, match="lead"):
        ImportanceGuard(lead=-1)
    assert ImportanceGuard(lead=24).needs.pass_lead == 24 and ImportanceGuard().needs.pass_lead == 0
    assert ImportanceGuard(aligned=True).needs.pass_aligned and not ImportanceGuard().needs.pass_aligned
    with pytest.raises(ValueError, match="aligned"):
        ImportanceGuard(aligned=1)
    assert Pipeline(get_preset("kvzip-copy-heads-lead")).needs.pass_lead == 32
    assert Pipeline(get_preset("kvzip-copy-heads-banded")).needs.pass_lead == 0
    with pytest.raises(ValueError, match="head_budget"):
        get_preset("kvzip", **{"clusterer.head_budget": "weird"})
        Pipeline(get_preset("kvzip", **{"clusterer.head_budget": "weird"}))


def test_model_pass_is_declared_through_needs():
    for name in ("kvzip", "kvzip-adakv", "kvzip-sentences", "kvzip-gsc", "kvzip-csm", "kvzip-csm-tokens",
                 "kvzip-d2o", "kvzip-d2o-tokens", "kvzip-sentences-median", "kvzip-d2o-median"):
        needs = Pipeline(get_preset(name)).needs
        assert needs.model_pass and needs.all_layers, name
    for name in ("snapkv", "semanticache", "centroidkv"):
        assert not Pipeline(get_preset(name)).needs.model_pass, name


def test_token_share_protects_best_tokens_per_head():
    N = 64
    state = make_state(5, B=1, H=2, N=N, vocab=VOCAB, with_membership=False)
    score = torch.rand(1, 2, N, generator=torch.Generator().manual_seed(9))
    state = state.replace(stats={"reconstruction": score})
    guard = ImportanceGuard(share=0.0, token_share=0.5)
    guard.prepare([state], torch.tensor([16]), torch.zeros(1, N, dtype=torch.bool))
    mask = guard(state)
    for h in range(2):
        assert set(mask[0, h].nonzero().flatten().tolist()) == set(score[0, h].topk(8).indices.tolist())
    with pytest.raises(ValueError, match="token_share"):
        ImportanceGuard(share=0.7, token_share=0.5)


def test_adaptive_sum_meets_the_budget_per_layer():
    state, _ = with_scores(make_state(3, B=2, H=3, N=256, vocab=VOCAB, with_membership=False))
    cfg = get_preset("kvzip", keep_ratio=0.25, on_infeasible="error", **{"clusterer.head_budget": "adaptive-sum"})
    out, report = Pipeline(cfg).compress(state, layer_idx=0)
    assert report.budget_met and torch.equal(out.valid.sum(-1).sum(-1), report.target.sum(-1))


def test_guard_adaptive_head_budget_splits_exact_tokens_over_heads():
    N, H = 64, 4
    state = make_state(6, B=1, H=H, N=N, vocab=VOCAB, with_membership=False)
    score = torch.rand(1, H, N, generator=torch.Generator().manual_seed(3))
    score[:, 0] *= 10  # head 0's tokens matter most: it takes more than its share, at most twice
    state = state.replace(stats={"reconstruction": score})
    guard = ImportanceGuard(share=0.0, token_share=0.25, head_budget="adaptive")
    guard.prepare([state], torch.tensor([32]), torch.zeros(1, N, dtype=torch.bool))
    counts = guard(state).sum(-1)[0]
    assert int(counts.sum()) == H * 8 and int(counts[0]) == 16 and bool((counts <= 16).all())
    # merging fills every head to the same slot count: the tensor stays rectangular at the budget
    cfg = get_preset("kvzip-csm", keep_ratio=0.5, on_infeasible="error",
                     guards=[{"name": "importance", "params": {"share": 0.2, "token_share": 0.3,
                                                              "head_budget": "adaptive"}}])
    big, _ = with_scores(make_state(3, B=2, H=3, N=256, vocab=VOCAB, with_membership=False))
    pipe = Pipeline(cfg)
    pipe.prepare([big])
    out, report = pipe.compress(big, layer_idx=0)
    assert report.budget_met and bool((out.valid.sum(-1) <= 128).all())
    with pytest.raises(ValueError, match="head_budget"):
        ImportanceGuard(head_budget="sum")


@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 8), st.integers(0, 10_000))
@CORE_SETTINGS
def test_sentence_median_equals_a_loop_over_sentences(B, T, num, seed):
    """The vectorized median per sentence equals torch.median (the lower median) of each
    sentence's tokens; empty sentences score 0."""
    from kvcompress.strategies.importance import sentence_median

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 5, (B, T), generator=g).float()  # ties on purpose
    sid = torch.randint(0, num, (B, T), generator=g).sort(-1).values
    got = sentence_median(x, sid, num)
    for b in range(B):
        for s in range(num):
            v = x[b][sid[b] == s]
            assert float(got[b, s]) == (float(v.median()) if v.numel() else 0.0)


def test_median_reduce_ranks_a_sentence_by_its_middle_token():
    """One sink-like token lifts a short sentence's mean above a fact's, not its median."""
    from kvcompress.strategies.importance import sentence_median

    x = torch.tensor([[9.0, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0]])
    sid = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    med = sentence_median(x, sid, 2)
    assert float(med[0, 0]) < float(med[0, 1])
    assert x[0, :3].mean() > x[0, 3:].mean()


# ---------------------------------------------------------------------------- surprisal
@given(st.integers(1, 3), st.integers(1, 12), st.integers(0, 10_000))
@CORE_SETTINGS
def test_ranks01_equals_a_loop(B, S, seed):
    from kvcompress.strategies.importance import ranks01

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (B, S), generator=g).float()  # ties on purpose
    eligible = torch.rand(B, S, generator=g) < 0.7
    got = ranks01(x, eligible)
    for b in range(B):
        idx = [i for i in range(S) if eligible[b, i]]
        # ascending by value, ties by index: position / (n - 1)
        order = sorted(idx, key=lambda i: (float(x[b, i]), i))
        for i in range(S):
            want = order.index(i) / max(1, len(idx) - 1) if i in idx else 0.0
            assert abs(float(got[b, i]) - want) < 1e-6, (b, i, got[b], want)


def _sentence_states(importance, surprisal=None):
    """3 layers over 4 sentences of 4 tokens; per-token importance [16] in every head."""
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 3, 0, 2, 5, 3, 4, 1, 2, 3]])
    N = ids.shape[1]
    states = []
    for layer in range(3):
        st_ = make_state(layer, B=1, H=2, N=N, D=4, vocab=VOCAB, with_membership=False)
        extras = {} if surprisal is None else {"surprisal": surprisal[None]}
        states.append(st_.replace(token_ids=ids, stats={"reconstruction": importance.expand(1, 2, N).clone()},
                                  extras={**st_.extras, **extras}))
    return states


def test_surprisal_lifts_the_sentence_the_model_could_not_guess():
    """Importance ties between sentences 1 and 2: importance alone takes the first; with the
    prefill surprisal the surprising one (sentence 2) wins; a surprising sentence of low importance
    does not beat one that is both."""
    imp = torch.full((16,), 0.1)
    imp[4:12] = 0.5
    sur = torch.ones(16)
    sur[8:12] = 5.0
    already = torch.zeros(1, 16, dtype=torch.bool)
    plain = ImportanceGuard(share=1.0, reduce="median")
    plain.prepare(_sentence_states(imp, sur), torch.tensor([4]), already)
    assert plain.chosen_tokens()[0].nonzero().flatten().tolist() == [4, 5, 6, 7]
    guard = ImportanceGuard(share=1.0, reduce="median", surprisal=1.0)
    assert guard.needs.surprisal and guard.needs.model_pass and not plain.needs.surprisal
    guard.prepare(_sentence_states(imp, sur), torch.tensor([4]), already)
    assert guard.chosen_tokens()[0].nonzero().flatten().tolist() == [8, 9, 10, 11]
    sur2 = torch.ones(16)
    sur2[12:16] = 3.0  # surprising but unimportant
    sur2[8:12] = 2.0
    guard.prepare(_sentence_states(imp, sur2), torch.tensor([4]), already)
    assert guard.chosen_tokens()[0].nonzero().flatten().tolist() == [8, 9, 10, 11]


def test_surprisal_guard_without_surprisal_is_a_clear_error():
    imp = torch.rand(16)
    with pytest.raises(ValueError, match="surprisal"):
        ImportanceGuard(surprisal=1.0).prepare(_sentence_states(imp), torch.tensor([4]),
                                               torch.zeros(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="surprisal"):
        ImportanceGuard(surprisal=1.0).prepare(_sentence_states(imp, torch.rand(5)), torch.tensor([4]),
                                               torch.zeros(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="surprisal"):
        ImportanceGuard(surprisal=-1.0)


def test_surprisal_presets_meet_budgets_and_declare_needs():
    state, _ = with_scores(make_state(3, B=2, H=3, N=256, vocab=VOCAB, with_membership=False))
    gen = torch.Generator().manual_seed(2)
    state = state.replace(extras={**state.extras, "surprisal": torch.rand(2, 256, generator=gen) * 5,
                                  "queries": torch.randn(2, state.num_heads, 32, state.head_dim, generator=gen)})
    for name in ("kvzip-sentences-surprisal", "kvzip-hybrid"):
        pipe = Pipeline(get_preset(name, keep_ratio=0.25, on_infeasible="error"))
        assert pipe.needs.surprisal and pipe.needs.model_pass, name
        out, report = pipe.compress(state, layer_idx=0)
        assert report.budget_met, name
        assert bool((out.valid.sum(-1) == 64).all()), (name, out.valid.sum(-1))
