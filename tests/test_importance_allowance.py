"""The importance guard's ``allowance_keep``: its allowances are sized at keep k at most. At a budget
of k or less of the tokens seen it is the guard without it, mask for mask; above, the sentences and
the per-head tokens take what keep k would give them, and the budget's extra slots stay free for
the clusterer's own choice; bad values named (the banded preset's budgets: test_importance_band.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state
from kvcompress.budget import target_slots
from kvcompress.presets import get_preset
from kvcompress.strategies.importance import COPY, ImportanceGuard

VOCAB = ("a", " b", " c", ".", " d", " e", "!", " f")
PARAMS = dict(reduce="median", token_share=0.15, head_budget="adaptive", copy_heads=0.5,
              other_token_share=0.5, ends=(".", "!"))


def _layers(seed, N, B=1, H=2, L=3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(VOCAB), (B, N), generator=gen)
    out = []
    for layer in range(L):
        s = make_state(seed + layer, B=B, H=H, N=N, vocab=VOCAB, with_membership=False)
        out.append(s.replace(token_ids=ids, stats={"reconstruction": torch.rand(B, H, N, generator=gen)},
                             extras={COPY: torch.rand(B, H, generator=gen)}))
    return out


def _masks(guard, states, budget, already):
    guard.prepare(states, budget, already)
    return guard.chosen_tokens(), [guard(s) for s in states]


@settings(CORE_SETTINGS, max_examples=25)
@given(seed=st.integers(0, 10_000), N=st.integers(8, 90), keep=st.floats(0.05, 0.25), k=st.floats(0.25, 1.0))
def test_at_or_below_keep_k_it_is_the_guard_without_it(seed, N, keep, k):
    states = _layers(seed, N)
    budget = target_slots(states[0].real_tokens(), keep, None)
    already = torch.zeros(1, N, dtype=torch.bool)
    already[:, :2] = True
    a_tok, a_masks = _masks(ImportanceGuard(share=0.8, allowance_keep=k, **PARAMS), states, budget, already)
    b_tok, b_masks = _masks(ImportanceGuard(share=0.8, **PARAMS), states, budget, already)
    assert torch.equal(a_tok, b_tok)
    for x, y in zip(a_masks, b_masks):
        assert torch.equal(x, y)


@settings(CORE_SETTINGS, max_examples=25)
@given(seed=st.integers(0, 10_000), N=st.integers(40, 120), keep=st.floats(0.3, 0.9))
def test_above_keep_k_the_allowances_are_those_of_keep_k(seed, N, keep):
    """Above k the capped guard chooses the sentences the uncapped guard chooses at budget k (the
    sentences' choice reads only the allowance), and no head keeps more own tokens than the
    uncapped guard gives at the larger budget."""
    states = _layers(seed, N)
    real = states[0].real_tokens()
    big, small = target_slots(real, keep, None), target_slots(real, 0.25, None)
    already = torch.zeros(1, N, dtype=torch.bool)
    already[:, :3] = True
    capped_tok, capped = _masks(ImportanceGuard(share=0.8, allowance_keep=0.25, **PARAMS), states, big, already)
    small_tok, _ = _masks(ImportanceGuard(share=0.8, **PARAMS), states, small, already)
    big_tok, uncapped = _masks(ImportanceGuard(share=0.8, **PARAMS), states, big, already)
    assert torch.equal(capped_tok, small_tok)
    room_small = int((small - 3).clamp(min=0))
    assert int((capped_tok & ~already).sum()) <= int(room_small * 0.8)  # the allowance counts free tokens
    for c, u in zip(capped, uncapped):
        assert int(c.sum()) <= int(u.sum())


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, True, "0.25"])
def test_bad_allowance_keep_is_named(bad):
    with pytest.raises(ValueError, match="allowance_keep"):
        ImportanceGuard(allowance_keep=bad)


def test_the_banded_preset_caps_at_keep_a_quarter():
    assert get_preset("kvzip-copy-heads-banded").guards[0].params["allowance_keep"] == 0.25
    assert "allowance_keep" not in get_preset("kvzip-copy-heads-fitted").guards[0].params  # its grids stand
