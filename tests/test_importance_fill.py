"""The importance guard's ``fill_share``: with ``allowance_keep`` k, a share of the slots a budget above
keep k adds goes to each head's own best tokens by reconstruction score. At or below keep k it is
the guard without it, mask for mask; above, each head keeps exactly the sentences plus its best
``own + fill`` free tokens (a slow per-head reference), the adaptive split keeps the layer's total,
and bad values are named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress.budget import target_slots
from kvcompress.presets import get_preset
from kvcompress.strategies.importance import ImportanceGuard
from test_importance_allowance import PARAMS, _layers, _masks

UNIFORM = dict(reduce="median", token_share=0.15, ends=(".", "!"))


def _already(N, n=2):
    already = torch.zeros(1, N, dtype=torch.bool)
    already[:, :n] = True
    return already


@settings(CORE_SETTINGS, max_examples=25)
@given(seed=st.integers(0, 10_000), N=st.integers(8, 90), keep=st.floats(0.05, 0.25), fill=st.floats(0.0, 1.0))
def test_at_or_below_keep_k_the_fill_changes_nothing(seed, N, keep, fill):
    states = _layers(seed, N)
    budget = target_slots(states[0].real_tokens(), keep, None)
    a_tok, a = _masks(ImportanceGuard(share=0.8, allowance_keep=0.25, fill_share=fill, **PARAMS), states, budget,
                      _already(N))
    b_tok, b = _masks(ImportanceGuard(share=0.8, allowance_keep=0.25, **PARAMS), states, budget, _already(N))
    assert torch.equal(a_tok, b_tok)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@settings(CORE_SETTINGS, max_examples=25)
@given(seed=st.integers(0, 10_000), N=st.integers(40, 120), keep=st.floats(0.3, 0.9), fill=st.floats(0.0, 1.0))
def test_above_keep_k_each_head_adds_its_best_fill_tokens(seed, N, keep, fill):
    """Uniform split, every head with the sentences: per head, the mask is the chosen sentences'
    tokens plus the best floor(room_k * token_share) + floor((room - room_k) * fill) of the others by
    reconstruction score (a loop over heads, the slow reference); the sentences are those without fill."""
    states = _layers(seed, N)
    real = states[0].real_tokens()
    budget, capped = target_slots(real, keep, None), target_slots(real, 0.25, None)
    already = _already(N)
    tok, masks = _masks(ImportanceGuard(share=0.8, allowance_keep=0.25, fill_share=fill, **UNIFORM), states, budget,
                        already)
    plain_tok, _ = _masks(ImportanceGuard(share=0.8, allowance_keep=0.25, **UNIFORM), states, budget, already)
    assert torch.equal(tok, plain_tok)
    room, room_k = int(budget) - 2, int(capped) - 2
    own = int(room_k * 0.15) + int((room - room_k) * fill)
    for state, mask in zip(states, masks):
        for h in range(state.num_heads):
            sentences = tok[0] & (state.positions[0, h] >= 0)
            scores = state.stats["reconstruction"][0, h].tolist()
            others = sorted((i for i in range(N) if not sentences[i]), key=lambda i: (-scores[i], i))
            expect = sentences.clone()
            expect[others[:own]] = True
            assert torch.equal(mask[0, h], expect), (h, own)


@settings(CORE_SETTINGS, max_examples=20)
@given(seed=st.integers(0, 10_000), N=st.integers(60, 120), keep=st.floats(0.4, 0.9))
def test_the_adaptive_fill_keeps_the_layer_total(seed, N, keep):
    """Ada-KV split (copy heads, other heads' own share): a larger fill adds exactly
    H * (fill tokens) exact slots per layer over all heads, however they are shared out."""
    states = _layers(seed, N)
    real = states[0].real_tokens()
    budget, capped = target_slots(real, keep, None), target_slots(real, 0.25, None)
    fill = int((int(budget) - int(capped)) * 0.5)
    _, none = _masks(ImportanceGuard(share=0.8, allowance_keep=0.25, **PARAMS), states, budget, _already(N))
    _, half = _masks(ImportanceGuard(share=0.8, allowance_keep=0.25, fill_share=0.5, **PARAMS), states, budget,
                     _already(N))
    for a, b in zip(none, half):
        assert int(b.sum()) - int(a.sum()) == a.shape[1] * fill


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5"])
def test_bad_fill_share_is_named(bad):
    with pytest.raises(ValueError, match="fill_share"):
        ImportanceGuard(allowance_keep=0.25, fill_share=bad)


def test_fill_share_without_allowance_keep_is_refused():
    with pytest.raises(ValueError, match="fill_share=0.5.*allowance_keep"):
        ImportanceGuard(fill_share=0.5)


def test_the_presets_without_fill_are_unchanged():
    assert "fill_share" not in get_preset("kvzip-copy-heads-noquery").guards[0].params
