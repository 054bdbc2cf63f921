"""The importance guard's ``upper_share``: the best-ranked chosen sentences held, exact, in the heads
without sentences of the upper layers (the pipeline tells a ``LayeredGuard`` which layer it is)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.protocols import LayeredGuard
from kvcompress.strategies.importance import COPY, ImportanceGuard, split_layers
from kvcompress.strategies.sentences import sentence_ids

from test_layer_budgets import VOCAB, _layers, assert_greedy_fill, free_lengths

L, N, B = 6, 240, 2
COPY_LAYER = 4  # _layers: layers 1 and 4 hold a head with a high copy score; copy_heads 0.05 picks layer 4's


def _params(**over) -> dict:
    (guard,) = get_preset("kvzip-copy-heads-layers-sentences").guards
    return {**guard.params, **over}


def _prepared(seed: int, keep: float = 0.25, **over) -> tuple[ImportanceGuard, list, torch.Tensor]:
    already = torch.zeros(B, N, dtype=torch.bool)
    already[:, :4] = True
    already[:, -32:] = True
    # the sinks and the recent window score 0, so that a head's own tokens are free slots: the
    # counts below are then exact
    states = [stt.replace(stats={"reconstruction": stt.stats["reconstruction"].masked_fill(already[:, None], 0.0)})
              for stt in _layers(L=L, N=N, B=B, seed=seed)]
    guard = ImportanceGuard(**_params(**over))
    guard.prepare(states, torch.full((B,), math.floor(N * keep)), already)
    return guard, states, already


def _copy_heads(state, guard) -> torch.Tensor:
    return state.extras[COPY] >= guard._copy_thr[:, None]  # [B, H]


def test_bad_upper_parameters_name_themselves():
    for bad in (-0.1, 1.5, float("nan"), "1"):
        with pytest.raises(ValueError, match="upper_share"):
            ImportanceGuard(**_params(upper_share=bad))
    with pytest.raises(ValueError, match="upper_share.*copy_heads 1"):
        ImportanceGuard(copy_heads=1.0, upper_share=0.5)
    for bad in (0.0, -1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="upper_from"):
            ImportanceGuard(**_params(upper_share=0.5, upper_from=bad))
    cfg = get_preset("kvzip-copy-heads-layers-sentences")
    (guard,) = cfg.guards
    with pytest.raises(ValueError, match="upper_share"):  # through a config, before any compression
        Pipeline(cfg.replace(guards=({"name": guard.name, "params": {**guard.params, "upper_share": 2.0}},)))


@settings(CORE_SETTINGS, max_examples=10)
@given(share=st.sampled_from([0.25, 0.6, 1.0]), seed=st.integers(0, 40), keep=st.sampled_from([0.25, 0.4]))
def test_upper_sentences_are_the_best_chosen_ones_that_fit_the_quota(share, seed, keep):
    """The upper set is part of the chosen sentences, fits floor(quota * share) (quota: a head
    without sentences' own tokens in a layer that gave room), and no chosen sentence left out of
    it would still fit (a slow check, sentence by sentence: the greedy choice leaves only longer
    ones out)."""
    guard, states, already = _prepared(seed, keep, upper_share=share)
    room = min(math.floor(N * keep), math.floor(N * 0.25)) - 36
    full_room = math.floor(N * keep) - 36
    lo = split_layers(1, L, 2.0)[1]
    other = math.floor(room * guard.other_token_share)
    quota = math.floor(other * min(1.0, (math.floor(math.floor(N * keep) * lo) - 36) / full_room))
    allowance = math.floor(quota * share)
    sid = sentence_ids(states[0].token_ids, VOCAB, guard.ends)
    chosen, upper = guard.chosen_tokens(), guard._upper
    assert guard._upper_first == 3
    assert not bool((upper & ~chosen).any())
    for b in range(B):
        lengths = free_lengths(sid[b], already[b])
        in_chosen = {int(sid[b, t]) for t in range(N) if chosen[b, t]}
        picked = {int(sid[b, t]) for t in range(N) if upper[b, t]}
        used = sum(lengths.get(s, 0) for s in picked)
        assert used == int(guard._upper_len[b]) and used <= allowance
        assert_greedy_fill(lengths, picked, in_chosen, allowance)


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_upper_layers_hold_the_sentences_in_place_of_own_tokens(share, head_budget):
    """Per layer: below ``upper_from`` (and for a layer of unknown index) the mask is the one
    without the option; from it on, the heads without sentences hold every upper token, the copy
    heads every chosen one, and the guard adds no more slots than without the option (the
    sentences replace own tokens): as many per head with uniform head budgets, at most as many per
    layer with the adaptive split (one quota over the heads of a layer, not always filled)."""
    guard, states, already = _prepared(3, upper_share=share, head_budget=head_budget)
    plain, _, _ = _prepared(3, head_budget=head_budget)
    even, _, _ = _prepared(3, head_budget="uniform")
    assert isinstance(guard, LayeredGuard)
    upper = guard._upper
    assert bool(upper.any())
    for layer, stt in enumerate(states):
        got, ref = guard.for_layer(stt, layer), plain.for_layer(stt, layer)
        assert torch.equal(guard(stt), plain(stt)) and torch.equal(guard.for_layer(stt, None), ref)
        if layer < guard._upper_first:
            assert torch.equal(got, ref), layer
            continue
        others = ~_copy_heads(stt, guard)  # [B, H]
        at = stt.positions.flatten(1)  # uncompressed: slot = token
        held = upper.gather(1, at).view_as(stt.positions)
        assert bool((got | ~(held & others[..., None])).all()), layer
        chosen = guard.chosen_tokens().gather(1, at).view_as(stt.positions)
        assert bool((got | ~(chosen & ~others[..., None])).all())
        # a sentence's tokens in the sinks or the recent window cost nothing: count the others
        free = ~already.gather(1, at).view_as(stt.positions)
        if head_budget == "uniform":
            assert torch.equal((got & free).sum(-1), (ref & free).sum(-1)), layer
        else:
            bound = (even.for_layer(stt, layer) & free).sum((1, 2))
            assert bool(((got & free).sum((1, 2)) <= bound).all()), layer


def test_through_the_pipeline_each_layer_meets_its_share_and_keeps_the_upper_sentences():
    """The pipeline passes each layer's index to the guard: every layer keeps exactly its share of
    the budget, and the upper layers' heads without sentences keep every upper token exact (a slot
    of its own, size 1) while the lower layers' do not all."""
    states = _layers(L=L, N=N, B=B, seed=5)
    cfg = get_preset("kvzip-copy-heads-layers-sentences", keep_ratio=0.25, on_infeasible="error")
    (spec,) = cfg.guards
    pipe = Pipeline(cfg.replace(guards=({"name": spec.name, "params": {**spec.params, "upper_share": 1.0}},)))
    pipe.prepare(states)
    guard = pipe.guards[0]
    hi, lo = split_layers(1, L, 2.0)
    lower_all = True
    for layer, stt in enumerate(states):
        out, report = pipe.compress(stt, layer_idx=layer)
        assert report.budget_met
        expect = max(1, math.floor(N * 0.25 * (hi if layer == COPY_LAYER else lo) + 1e-9))
        assert bool((out.valid.sum(-1) == expect).all()), (layer, out.valid.sum(-1), expect)
        others = ~_copy_heads(stt, guard)
        for b in range(B):
            want = set(torch.nonzero(guard._upper[b]).flatten().tolist())
            for h in torch.nonzero(others[b]).flatten().tolist():
                exact = out.valid[b, h] & (out.log_sizes[b, h] == 0)
                kept = set(out.positions[b, h][exact].tolist())
                if layer >= guard._upper_first:
                    assert want <= kept, (layer, b, h, sorted(want - kept)[:5])
                else:
                    lower_all &= want <= kept
    assert not lower_all  # without the option the lower layers' other heads drop some of them
