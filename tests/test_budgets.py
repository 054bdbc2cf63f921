"""Every budget works or degrades clearly: the delimiter chunker's anchors="merge" mode (against a
slow reference), SemantiCache's fallback below its anchor floor, one BudgetWarning per pipeline or
per budget_warnings() scope, on_infeasible="error"/"best_effort", rows shorter than the protected
sinks + recent window, and errors that name the method asked for."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, strategies as st

import kvcompress as kc
from conftest import BPE_VOCAB, CORE_SETTINGS, DELIMITER_TEXTS, assert_state_unchanged, clone_state, make_state
from kvcompress.pipeline import BudgetWarning, budget_warnings, chunk_floor
from kvcompress.strategies.chunkers import DelimiterChunker


def reference_merge_chunks(state, protected) -> torch.Tensor:
    """Slow loop: a run opens at a valid non-delimiter whose previous valid slot is a delimiter;
    every valid, unprotected slot (delimiters included) takes the number of runs opened so far."""
    B, H, N = state.valid.shape
    ids = state.slot_token_ids()
    out = torch.full((B, H, N), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            runs, prev_delim = 0, False
            for n in range(N):
                if not state.valid[b, h, n]:
                    continue
                delim = BPE_VOCAB[int(ids[b, h, n])] in DELIMITER_TEXTS
                if not delim and prev_delim:
                    runs += 1
                prev_delim = delim
                if not protected[b, h, n]:
                    out[b, h, n] = runs
    return out


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), N=st.integers(1, 30), padded=st.booleans(), p=st.floats(0.0, 0.5))
def test_merge_anchors_chunks_match_the_reference(seed, N, padded, p):
    gen = torch.Generator().manual_seed(seed)
    pad = [int(torch.randint(0, N, (), generator=gen)) for _ in range(2)] if padded else None
    state = make_state(seed, B=2, H=2, N=N, pad=pad, with_membership=False)
    protected = (torch.rand(2, 2, N, generator=gen) < p) & state.valid
    got = DelimiterChunker(anchors="merge")(state, protected)
    assert torch.equal(got, reference_merge_chunks(state, protected))
    kept = DelimiterChunker()(state, protected)
    # no anchors left, and never more chunks than the paper's chunking has runs
    assert bool(((got >= 0) == (state.valid & ~protected)).all())
    assert bool((chunk_floor(state.valid, got) <= chunk_floor(state.valid, kept)).all())


def test_anchor_mode_is_checked():
    with pytest.raises(ValueError, match="anchors"):
        DelimiterChunker(anchors="drop")


def _prose_state(seed=0, N=120):
    """Clauses of 3-8 words, each ended by one or two delimiter tokens (like English prose: about
    a fifth of the tokens): the paper's floor (anchors + one slot per run) is above a keep of 0.25."""
    gen = torch.Generator().manual_seed(seed)
    words = [i for i, t in enumerate(BPE_VOCAB) if t not in DELIMITER_TEXTS]
    delims = [i for i, t in enumerate(BPE_VOCAB) if t in DELIMITER_TEXTS]
    rows = []
    for _ in range(2):
        ids = []
        while len(ids) < N:
            ids += [words[int(i)] for i in torch.randint(0, len(words), (int(torch.randint(3, 9, ())),), generator=gen)]
            ids += [delims[int(i)] for i in torch.randint(0, len(delims), (int(torch.randint(1, 3, ())),), generator=gen)]
        rows.append(ids[:N])
    state = make_state(seed, B=2, H=2, N=N, with_membership=False)
    return state.replace(token_ids=torch.tensor(rows))


def test_semanticache_meets_a_budget_below_its_anchor_floor_through_the_fallback():
    state = _prose_state()
    snapshot = clone_state(state)
    faithful = kc.Pipeline("semanticache", keep_ratio=0.2, sinks=2, recent=4, fallback_chunker=None,
                           on_infeasible="best_effort")
    _, missed = faithful.compress(state)
    assert not missed.budget_met and missed.keep_ratio > 0.3  # the paper's chunking cannot get there
    pipe = kc.Pipeline("semanticache", keep_ratio=0.2, sinks=2, recent=4)
    with pytest.warns(BudgetWarning, match=r"keep_ratio=0.2 met.*fallback chunker 'delimiter'"):
        out, report = pipe.compress(state)
    assert report.budget_met and bool((report.slots_per_head <= 24).all())  # floor(120 * 0.2)
    assert_state_unchanged(state, snapshot)
    # the fallback is used only when needed: at 0.5 the paper's chunks reach it, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, easy = kc.Pipeline("semanticache", keep_ratio=0.6, sinks=2, recent=4).compress(state)
    assert easy.budget_met
    # and a strict pipeline is satisfied by the fallback too
    _, strict = kc.Pipeline("semanticache", keep_ratio=0.2, sinks=2, recent=4, on_infeasible="error").compress(state)
    assert strict.budget_met


def test_out_of_reach_budget_warns_once_per_pipeline_and_error_raises():
    state = _prose_state()
    pipe = kc.Pipeline("semanticache", keep_ratio=0.05, sinks=4, recent=16, fallback_chunker=None)
    with pytest.warns(BudgetWarning) as caught:
        for layer in range(4):
            _, report = pipe.compress(state, layer_idx=layer)
            assert not report.budget_met
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "keep_ratio=0.05 is out of reach: keep reached" in msg and "20 protected (sinks=4, recent=16)" in msg
    assert "on_infeasible='error'" in msg
    with pytest.raises(kc.BudgetError, match="keep_ratio=0.05 is infeasible"):
        kc.Pipeline("semanticache", keep_ratio=0.05, sinks=4, recent=16, on_infeasible="error",
                    fallback_chunker=None).compress(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.Pipeline("semanticache", keep_ratio=0.05, sinks=4, recent=16, on_infeasible="best_effort",
                    fallback_chunker=None).compress(state)


def test_a_budget_warnings_scope_gathers_every_compression_into_one_warning():
    state = _prose_state()
    with pytest.warns(BudgetWarning) as caught:
        with budget_warnings() as notes:
            for layer in range(3):  # a fresh pipeline each time: still one warning for the scope
                kc.Pipeline("streamingllm", keep_ratio=0.1, sinks=4, recent=16).compress(state, layer_idx=layer)
    assert len(caught) == 1 and len(notes) == 3
    assert "3 layer compressions alike" in str(caught[0].message)
    worst = max(n.keep for n in notes)
    assert f"keep reached {worst:.3f}" in str(caught[0].message)


@pytest.mark.parametrize("preset", ["semanticache", "centroidkv", "snapkv", "streamingllm", "h2o", "knorm", "cam",
                                    "semanticache-fixed64"])
def test_rows_shorter_than_the_protection_stay_whole_without_error(preset):
    """Row 1 holds 6 real tokens, within sinks + recent = 4 + 8: it stays as it is, even with
    on_infeasible="error"; row 0 is compressed to its budget."""
    state = make_state(3, B=2, H=2, N=60, pad=[0, 54], with_membership=False)
    extras = {"queries": torch.randn(2, 2, 8, 8), "attn_acc": torch.rand(2, 2, 60)}
    state = state.replace(extras=extras)
    pipe = kc.Pipeline(preset, keep_ratio=0.5, sinks=4, recent=8, on_infeasible="error", query_window=8)
    out, report = pipe.compress(state)
    assert int(out.valid[1].sum(-1).min()) == 6 and int(out.valid[1].sum(-1).max()) == 6
    assert bool((report.slots_per_head[0] <= 30).all()) and report.budget_met


def test_a_whole_short_prompt_is_left_uncompressed():
    state = make_state(4, B=1, H=2, N=4, with_membership=False)  # within every preset's sinks + recent
    for preset in ("semanticache", "centroidkv", "streamingllm"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, report = kc.Pipeline(preset, keep_ratio=0.25, on_infeasible="error").compress(state)
        assert report.budget_met and torch.equal(out.keys, state.keys)


def test_missing_statistics_error_names_the_method():
    state = kc.KVState.from_raw(torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8))
    with pytest.raises(ValueError, match=r"^pipeline 'd2o' \(clusterer 'd2o'\): h2o: state.stats/extras"):
        kc.Pipeline("d2o").compress(state)
    with pytest.raises(ValueError, match=r"^pipeline 'h2o' \(clusterer 'evict'\): h2o: state.stats/extras"):
        kc.Pipeline("h2o").compress(state)


def test_fallback_chunker_in_config_round_trips_and_follows_the_chunker():
    cfg = kc.get_preset("semanticache", keep_ratio=0.2)
    assert cfg.fallback_chunker == kc.StrategySpec("delimiter", {"anchors": "merge"})
    assert kc.PipelineConfig.from_json(cfg.to_json()) == cfg
    assert cfg.replace(chunker="fixed").fallback_chunker is None  # it backed up the delimiter chunker
    assert cfg.replace(**{"fallback_chunker.delimiters": ["."]}).fallback_chunker.params["delimiters"] == (".",)
    assert kc.get_preset("semanticache-fixed64").fallback_chunker is None
    with pytest.raises(ValueError, match="fallback_chunker"):
        cfg.replace(fallback_chunker=None, **{"fallback_chunker.anchors": "merge"})
    assert kc.PipelineConfig().on_infeasible == "warn"


# ---------------------------------------------------------------- below the floor, exactly

def _text_state(seed, N, delim_rate, pad, B=2, H=2):
    """Random tokens with a given share of delimiters (1.0: every token one), optional left padding."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.tensor([i for i, t in enumerate(BPE_VOCAB) if t not in DELIMITER_TEXTS])
    delims = torch.tensor([i for i, t in enumerate(BPE_VOCAB) if t in DELIMITER_TEXTS])
    is_delim = torch.rand(B, N, generator=gen) < delim_rate
    ids = torch.where(is_delim, delims[torch.randint(0, len(delims), (B, N), generator=gen)],
                      words[torch.randint(0, len(words), (B, N), generator=gen)])
    state = make_state(seed, B=B, H=H, N=N, pad=pad, with_membership=False)
    return state.replace(token_ids=ids)


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), N=st.integers(1, 160), budget=st.floats(0.01, 1.0),
       delim_rate=st.sampled_from([0.0, 0.15, 0.3, 0.6, 1.0]), sinks=st.integers(0, 8),
       recent=st.integers(0, 40), padded=st.booleans(), max_slots=st.booleans())
def test_semanticache_meets_every_budget_on_any_text(seed, N, budget, delim_rate, sinks, recent, padded, max_slots):
    """Any text, any budget in (0, 1] (or any slot cap): every head of a row longer than sinks +
    recent ends within its budget, even with on_infeasible="error"; shorter rows stay whole; and
    where the paper's chunking reaches the budget the result is the paper's, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    pad = [int(torch.randint(0, N, (), generator=gen)) for _ in range(2)] if padded else None
    state = _text_state(seed, N, delim_rate, pad)
    snapshot = clone_state(state)
    cap = {"max_slots": max(1, int(budget * N)), "keep_ratio": None} if max_slots else {"keep_ratio": budget}
    pipe = kc.Pipeline("semanticache", sinks=sinks, recent=recent, on_infeasible="error", **cap)
    out, report = pipe.compress(state)
    assert_state_unchanged(state, snapshot)
    real = state.real_tokens()  # [B]
    slots = out.valid.sum(-1)  # [B, H]
    for b in range(2):
        n = int(real[b])
        if n <= sinks + recent:
            assert bool((slots[b] == n).all())  # left whole
        else:
            limit = cap["max_slots"] if max_slots else max(1, int(n * budget + 1e-9))
            assert int(slots[b].max()) <= limit, (n, limit, slots[b])
    assert report.budget_met
    faithful = kc.Pipeline("semanticache", sinks=sinks, recent=recent, on_infeasible="best_effort",
                           fallback_chunker=None, **cap)
    ref, ref_report = faithful.compress(state)
    if ref_report.budget_met:
        assert pipe.chunking(state).level == "chunker"
        for x, y in ((out.keys, ref.keys), (out.log_sizes, ref.log_sizes), (out.positions, ref.positions)):
            assert torch.equal(x, y)


def reference_join(valid, chunk_ids, groups):
    """Slow loop: chunk k of K (in slot order) joins group k * G // K when K > G."""
    out = chunk_ids.clone()
    B, H, N = chunk_ids.shape
    for b in range(B):
        for h in range(H):
            order = []
            for n in range(N):
                c = int(chunk_ids[b, h, n])
                if valid[b, h, n] and c >= 0 and (not order or order[-1] != c):
                    order.append(c)
            K, G = len(order), int(groups[b, h])
            if K <= G:
                continue
            rank = {c: k for k, c in enumerate(order)}
            for n in range(N):
                c = int(chunk_ids[b, h, n])
                if valid[b, h, n] and c >= 0:
                    out[b, h, n] = rank[c] * G // K
    return out


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), N=st.integers(1, 40), G=st.integers(1, 12), padded=st.booleans())
def test_join_chunks_matches_the_reference_and_fits(seed, N, G, padded):
    from kvcompress.pipeline import join_chunks
    gen = torch.Generator().manual_seed(seed)
    pad = [int(torch.randint(0, N, (), generator=gen)) for _ in range(2)] if padded else None
    state = _text_state(seed, N, 0.3, pad)
    protected = (torch.rand(2, 2, N, generator=gen) < 0.2) & state.valid
    ids = DelimiterChunker(anchors="merge")(state, protected)
    groups = torch.randint(1, G + 1, (2, 2), generator=gen)
    got = join_chunks(state.valid, ids, groups)
    assert torch.equal(got, reference_join(state.valid, ids, groups))
    fixed = (state.valid & (ids < 0)).sum(-1)
    assert bool((chunk_floor(state.valid, got) <= fixed + groups).all())
    assert bool(((got >= 0) == (ids >= 0)).all())  # only chunk members are regrouped


def test_a_short_prompt_at_a_low_budget_shrinks_the_window_to_half_the_budget():
    """89 tokens of 7-token sentences at 0.25: sinks 4 + recent 32 alone exceed the 22 slots, so
    the window shrinks to 11 (4 sinks + 7 recent) and the rest is joined into 11 runs."""
    vocab = ("w", ".")
    ids = torch.tensor([[1 if i % 7 == 6 else 0 for i in range(89)]])
    state = kc.KVState.from_raw(torch.randn(1, 2, 89, 8), torch.randn(1, 2, 89, 8), token_ids=ids, vocab=vocab)
    pipe = kc.Pipeline("semanticache", keep_ratio=0.25, sinks=4, recent=32)
    chunks = pipe.chunking(state)
    assert chunks.level == "window"
    assert torch.equal(chunks.protected[0, 0].nonzero().flatten(), torch.tensor([0, 1, 2, 3, *range(82, 89)]))
    with pytest.warns(BudgetWarning, match="keep_ratio=0.25 met.*recent window shrunk"):
        out, report = pipe.compress(state)
    assert report.budget_met and int(out.valid.sum(-1).max()) <= 22
    # 285 tokens: the window fits; clauses are joined in runs of about two
    ids = torch.tensor([[1 if i % 7 == 6 else 0 for i in range(285)]])
    state = kc.KVState.from_raw(torch.randn(1, 2, 285, 8), torch.randn(1, 2, 285, 8), token_ids=ids, vocab=vocab)
    pipe = kc.Pipeline("semanticache", keep_ratio=0.25, sinks=4, recent=32)  # warns once per pipeline
    assert pipe.chunking(state).level == "joined"
    with pytest.warns(BudgetWarning, match="runs of its chunks joined"):
        out, report = pipe.compress(state)
    assert report.budget_met and int(out.valid.sum(-1).max()) <= 71


def test_viz_shows_the_chunks_the_compression_used_below_the_floor():
    """cluster_view draws the chunking the first round used: at a budget below the anchors' floor
    the delimiters are clause members (no "anchor" role) and every cluster lies in one shown chunk."""
    from kvcompress.viz import cluster_view

    vocab = ("w", ".")
    ids = torch.tensor([[1 if i % 4 == 3 else 0 for i in range(120)]])  # a delimiter every 4 tokens
    gen = torch.Generator().manual_seed(0)
    state = kc.KVState.from_raw(torch.randn(1, 2, 120, 8, generator=gen), torch.randn(1, 2, 120, 8, generator=gen),
                                token_ids=ids, vocab=vocab)
    low = kc.Pipeline("semanticache", keep_ratio=0.2, sinks=2, recent=4, on_infeasible="best_effort")
    view, report = cluster_view(low, state)
    assert report.budget_met and "anchor" not in view.roles
    for members in view.clusters():
        assert len({int(view.chunk_ids[t]) for t in members}) == 1
    paper = kc.Pipeline("semanticache", keep_ratio=0.9, sinks=2, recent=4)
    view, _ = cluster_view(paper, state)
    assert view.roles.count("anchor") == sum(1 for t in range(2, 116) if t % 4 == 3)  # the paper's anchors
