"""Guards: protected tokens are never merged or evicted, budgets still met, sentences whole and
shared by every head and layer; sentence cutting and selection against plain-loop references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import CORE_SETTINGS, make_state

import kvcompress as kc
from kvcompress.pipeline import GUARD_MARK
from kvcompress.strategies.guards import NeverMergeGuard, SentenceGuard
from kvcompress.strategies.sentences import (
    literal_signal, novelty_signal, query_signal, select_sentences, sentence_ids,
)
from kvcompress.types import KVState

# token 0..9: words; 10: "."; 11: " 7" (a digit); 12: "\n"
VOCAB = tuple([f" w{chr(97 + i)}" for i in range(10)] + [".", " 7", "\n"])


def _members(state: KVState) -> torch.Tensor:
    return state.stats["member"]  # [B, H, M, T]: tokens each slot holds


def _text_state(seed: int, B=1, H=2, T=200, D=16, digits_at=(), sentence_len=10) -> KVState:
    """Random keys; sentences of ``sentence_len`` tokens ending in "."; digit tokens at ``digits_at``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 10, (B, T), generator=gen)
    ids[:, sentence_len - 1::sentence_len] = 10
    for p in digits_at:
        ids[:, p] = 11
    keys = torch.randn(B, H, T, D, generator=gen)
    values = torch.randn(B, H, T, D, generator=gen)
    st_ = KVState.from_raw(keys, values, token_ids=ids, vocab=VOCAB)
    member = torch.eye(T).expand(B, H, T, T).clone()
    return st_.replace(stats={"member": member})


# ---------------------------------------------------------------------------- sentence cutting
@CORE_SETTINGS
@given(st.lists(st.integers(0, 12), min_size=1, max_size=60))
def test_sentence_ids_match_a_plain_loop(tokens):
    ids = torch.tensor([tokens])
    got = sentence_ids(ids, VOCAB)[0].tolist()
    want, cur = [], 0
    for t in tokens:
        want.append(cur)
        if any(c in VOCAB[t] for c in ".!?\n"):
            cur += 1  # the ender belongs to the sentence it ends
    assert got == want


@CORE_SETTINGS
@given(st.lists(st.tuples(st.floats(-1, 5), st.integers(0, 9)), min_size=1, max_size=12), st.integers(0, 40))
def test_select_sentences_takes_the_best_that_fit(rows, allowance):
    scores = torch.tensor([[s for s, _ in rows]], dtype=torch.float32)
    lengths = torch.tensor([[n for _, n in rows]], dtype=torch.float32)
    got = select_sentences(scores, lengths, torch.tensor([allowance]))[0].tolist()
    # reference: walk sentences by descending score (stable), skip those that do not fit
    vals = scores[0].tolist()  # as float32 sees them
    order = sorted((i for i, (v, (_, n)) in enumerate(zip(vals, rows)) if v > 0 and n > 0), key=lambda i: -vals[i])
    want, used = [False] * len(rows), 0
    for i in order:
        if used + rows[i][1] <= allowance:
            want[i], used = True, used + rows[i][1]
    assert got == want


# ---------------------------------------------------------------------------- never-merge
@CORE_SETTINGS
@given(st.integers(0, 10_000), st.integers(0, 40), st.integers(1, 12), st.sampled_from(
    ["semanticache", "semanticache-fixed64", "centroidkv"]))
def test_never_merge_spans_are_never_merged_and_budget_met(seed, start, length, preset):
    state = make_state(seed, N=48, D=8)
    span = (start, min(start + length, 48))
    cfg = kc.get_preset(preset, keep_ratio=0.5, sinks=2, recent=4, on_infeasible="best_effort",
                        guards=[{"name": "never-merge", "params": {"spans": [list(span)]}}])
    if preset == "centroidkv":
        cfg = cfg.replace(chunker=kc.StrategySpec("csm", {"size": 16}))
    out, report = kc.Pipeline(cfg).compress(state)
    members = _members(out)  # [B, H, M, T]
    for t in range(*span):
        holders = members[..., t] > 0  # [B, H, M]
        assert int(holders.sum()) == state.batch_size * state.num_heads  # still there, once per head
        sizes = out.log_sizes.exp()[holders]
        torch.testing.assert_close(sizes, torch.ones_like(sizes))  # alone in its slot
    assert bool((out.valid.sum(-1) <= report.target).all()) == report.budget_met


def test_never_merge_by_token_id_and_bad_params():
    state = make_state(3, N=40)
    guard = NeverMergeGuard(token_ids=(2,))
    out, _ = kc.Pipeline("semanticache-fixed64", keep_ratio=0.5, sinks=0, recent=0,
                         guards=[{"name": "never-merge", "params": {"token_ids": [2]}}]).compress(state)
    protected = guard(state)
    assert bool(protected.any())
    kept = out.log_sizes.exp()[out.slot_token_ids() == 2]
    assert int((state.token_ids == 2).sum()) * state.num_heads == kept.numel()
    with pytest.raises(ValueError, match="spans"):
        NeverMergeGuard(spans=[(5, 2)])
    with pytest.raises(ValueError, match="token_ids"):
        NeverMergeGuard(token_ids=(-1,))


# ---------------------------------------------------------------------------- sentence guard
def test_sentence_guard_bad_params_name_the_parameter():
    with pytest.raises(ValueError, match="share"):
        SentenceGuard(share=1.5)
    with pytest.raises(ValueError, match="signals"):
        SentenceGuard(signals=("oracle",))
    with pytest.raises(ValueError, match="signals"):
        SentenceGuard(signals=())


def test_literal_signal_keeps_the_sentence_with_the_number_whole_at_a_quarter():
    # sentence 7 (tokens 70..79) holds a 4-digit number
    state = _text_state(0, T=200, digits_at=(73, 74, 75, 76))
    cfg = kc.get_preset("semanticache-fixed64", keep_ratio=0.25, sinks=2, recent=4,
                        guards=[{"name": "sentences", "params": {"signals": ["literal"], "share": 0.2}}])
    pipe = kc.Pipeline(cfg)
    out, report = pipe.compress(state)
    assert report.budget_met and bool((out.valid.sum(-1) <= 50).all())
    chosen = pipe.guards[0].chosen_tokens()[0]
    assert chosen[70:80].all() and int(chosen.sum()) == 10  # the whole sentence, nothing else
    members = _members(out)
    for t in range(70, 80):
        holders = members[..., t] > 0
        assert int(holders.sum()) == state.num_heads
        assert bool((out.log_sizes.exp()[holders] == 1).all())
    assert int(out.stats[GUARD_MARK].sum()) == 10 * state.num_heads


def test_query_signal_finds_the_sentence_the_queries_attend_to():
    B, H, T, D = 1, 2, 120, 16
    state = _text_state(1, B=B, H=H, T=T, D=D)
    # queries pointing at the keys of sentence 5 (tokens 50..59) in every head
    target = state.keys[:, :, 52]  # [B, H, D]
    queries = (8 * target)[:, :, None, None, :].expand(B, H, 2, 4, D).reshape(B, H * 2, 4, D)
    states = [state.replace(extras={"queries": queries}) for _ in range(3)]
    sid = sentence_ids(state.token_ids, VOCAB)
    score = query_signal(states, sid, int(sid.max()) + 1, skip_layers=0)
    assert int(score[0].argmax()) == 5
    with pytest.raises(ValueError, match="query_window"):
        query_signal([state], sid, int(sid.max()) + 1)


def test_novelty_signal_finds_the_odd_sentence():
    state = _text_state(2, T=200)
    v = state.values.clone()
    v[:, :, :] = v[:, :, :1] + 0.1 * v  # every value near one direction...
    v[:, :, 100:110] = -5 * state.values[:, :, :1]  # ...but sentence 10 points elsewhere
    state = state.replace(values=v)
    sid = sentence_ids(state.token_ids, VOCAB)
    score = novelty_signal([state, state], sid, int(sid.max()) + 1)
    assert int(score[0].argmax()) == 10


@pytest.mark.parametrize("preset", ["semanticache-safe", "centroidkv-safe"])
@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_safe_presets_meet_the_budget_and_keep_chosen_sentences_in_every_layer(preset, keep):
    B, H, T, D = 2, 2, 600, 16
    base = _text_state(10, B=B, H=H, T=T, D=D, digits_at=(203, 204, 205))
    gen = torch.Generator().manual_seed(5)
    layers = [base.replace(keys=torch.randn(B, H, T, D, generator=gen), values=torch.randn(B, H, T, D, generator=gen),
                           extras={**base.extras, "queries": torch.randn(B, 2 * H, 32, D, generator=gen)})
              for _ in range(3)]  # same tokens, per-layer keys, values and queries
    pipe = kc.Pipeline(preset, keep_ratio=keep)
    pipe.prepare(layers)
    chosen = pipe.guards[0].chosen_tokens()  # [B, T]
    assert chosen[:, 200:210].all()  # the digit sentence
    budget = int(T * keep)
    for i, state in enumerate(layers):
        out, report = pipe.compress(state, layer_idx=i)
        assert report.budget_met and bool((out.valid.sum(-1) <= budget).all())
        members = _members(out)  # [B, H, M, T]
        alone = (members > 0) & (out.log_sizes.exp() == 1)[..., None]
        for b in range(B):
            toks = chosen[b].nonzero().squeeze(1)
            # every chosen token sits alone in a slot in every head of every layer
            assert bool(alone[b][..., toks].any(dim=1).all())


def test_guard_share_zero_is_a_no_op():
    state = _text_state(4, T=160)
    plain, _ = kc.Pipeline("semanticache-fixed64", keep_ratio=0.5).compress(state)
    cfg = kc.get_preset("semanticache-fixed64", keep_ratio=0.5,
                        guards=[{"name": "sentences", "params": {"signals": ["literal"], "share": 0.0}}])
    guarded, _ = kc.Pipeline(cfg).compress(state)
    torch.testing.assert_close(guarded.keys, plain.keys, rtol=0, atol=0)
    torch.testing.assert_close(guarded.log_sizes, plain.log_sizes, rtol=0, atol=0)


def test_marks_persist_through_a_later_compression_by_another_pipeline():
    state = _text_state(6, T=300, digits_at=(51, 52))
    cfg = kc.get_preset("semanticache-fixed64", keep_ratio=0.5, sinks=2, recent=4,
                        guards=[{"name": "sentences", "params": {"signals": ["literal"], "share": 0.2}}])
    first, _ = kc.Pipeline(cfg).compress(state)
    # a fresh pipeline (as at decode time) has not decided anything: the marks carry the decision
    again, report = kc.Pipeline(cfg.replace(keep_ratio=0.3)).compress(first)
    assert report.budget_met
    members = _members(again)
    for t in range(50, 60):
        holders = members[..., t] > 0
        assert bool((again.log_sizes.exp()[holders] == 1).all())


def test_the_input_state_is_untouched_and_a_failure_changes_nothing():
    state = _text_state(7, T=200, digits_at=(11,))
    before = {k: v.clone() for k, v in (("keys", state.keys), ("log_sizes", state.log_sizes))}
    cfg = kc.get_preset("semanticache-safe", keep_ratio=0.02, sinks=2, recent=4, on_infeasible="error")
    with pytest.raises(kc.BudgetError):
        kc.Pipeline(cfg).compress(state.replace(extras={**state.extras, "queries": torch.randn(1, 4, 8, 16)}))
    assert GUARD_MARK not in state.stats
    torch.testing.assert_close(state.keys, before["keys"], rtol=0, atol=0)
    torch.testing.assert_close(state.log_sizes, before["log_sizes"], rtol=0, atol=0)


def test_literal_signal_counts_digit_tokens():
    ids = torch.tensor([[11, 11, 10, 0, 10, 11, 12]])
    sid = sentence_ids(ids, VOCAB)
    assert literal_signal(ids, VOCAB, sid, 3).tolist() == [[2.0, 0.0, 1.0]]


def test_prepare_and_selection_reject_mismatched_inputs_before_deciding():
    a, b = _text_state(8, T=100), _text_state(9, T=120)
    pipe = kc.Pipeline("semanticache-safe", keep_ratio=0.5)
    with pytest.raises(ValueError, match="states"):
        pipe.prepare([a, b])  # layers of different sequences
    assert pipe.guards[0].chosen_tokens() is None  # nothing was decided
    with pytest.raises(ValueError, match="states"):
        pipe.prepare([])
    with pytest.raises(ValueError, match="lengths"):
        select_sentences(torch.ones(1, 3), torch.ones(1, 4), torch.tensor([5]))
    with pytest.raises(ValueError, match="allowance"):
        select_sentences(torch.ones(2, 3), torch.ones(2, 3), torch.tensor([5]))
