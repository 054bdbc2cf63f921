"""The importance guard's ``band`` (each token's importance relative to the median of its
reconstruction chunk) and the ``kvzip-copy-heads-banded`` preset: band_relative against a slow
per-band reference, a distance bias that hides an early fact without the band and not with it,
band 0 identical to no band, bad values named, budgets met exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state
from kvcompress.hf.reconstruct import DEFAULT_CHUNK
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies.importance import (COPY, RECONSTRUCTION_CHUNK, ImportanceGuard, band_relative,
                                              token_importance)
from kvcompress.strategies.sentences import sentence_ids

VOCAB = ("a", " b", " c", ".", " d", " e", "!", " f")


def reference_band_relative(x, free, band):
    """Slow: per row and band, torch.median (the lower median) of the free tokens; divide by it
    when there is one and it is positive."""
    out = x.clone()
    B, T = x.shape
    for b in range(B):
        for start in range(0, T, band):
            sel = [t for t in range(start, min(start + band, T)) if free[b, t]]
            if not sel:
                continue
            med = float(torch.median(x[b, sel]))
            if med > 0:
                out[b, start: start + band] = x[b, start: start + band] / med
    return out


@settings(CORE_SETTINGS, max_examples=40)
@given(seed=st.integers(0, 10_000), T=st.integers(1, 70), band=st.integers(1, 30), zeros=st.booleans())
def test_band_relative_equals_the_slow_reference(seed, T, band, zeros):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(2, T, generator=gen) * 5
    if zeros:
        x[:, : T // 2] = 0.0  # bands whose median is 0 are left as they are
    free = torch.rand(2, T, generator=gen) > 0.3
    got = band_relative(x, free, band)
    torch.testing.assert_close(got, reference_band_relative(x, free, band), rtol=0, atol=0)


def test_the_pass_and_the_band_share_one_chunk():
    assert DEFAULT_CHUNK == RECONSTRUCTION_CHUNK
    assert get_preset("kvzip-copy-heads-banded").guards[0].params["band"] == RECONSTRUCTION_CHUNK


def _biased_layers(N=96, band=32, L=3, H=2, seed=0):
    """Sentences of 8 tokens; the reconstruction scores of band k are scaled by 4^k (the distance
    bias: the first chunk copied from farthest); in band 0 one sentence (tokens 8-15) is 3x its
    band's level, every other token at its band's level with a little noise."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(1, N, dtype=torch.long)
    ids[0, 7::8] = 3  # "." ends every 8th token
    scale = 4.0 ** (torch.arange(N) // band).float()  # [N]
    base = (1 + 0.05 * torch.rand(L, H, N, generator=gen)) * scale
    base[:, :, 8:16] *= 3.0
    out = []
    for layer in range(L):
        s = make_state(seed + layer, B=1, H=H, N=N, vocab=VOCAB, with_membership=False)
        out.append(s.replace(token_ids=ids, stats={"reconstruction": base[layer][None].clone()},
                             extras={COPY: torch.rand(1, H, generator=gen)}))
    return out


def test_band_finds_the_early_sentence_the_distance_bias_hides():
    states = _biased_layers()
    budget, already = torch.tensor([24]), torch.zeros(1, 96, dtype=torch.bool)
    already[:, :2] = True
    # allowance floor(22 * 0.4) = 8 tokens: one sentence
    plain = ImportanceGuard(share=0.4, reduce="median", ends=(".",))
    plain.prepare(states, budget, already)
    banded = ImportanceGuard(share=0.4, reduce="median", band=32, ends=(".",))
    banded.prepare(states, budget, already)
    fact = slice(8, 16)
    assert not bool(plain.chosen_tokens()[0, fact].any())  # a late sentence wins by its distance
    assert bool(banded.chosen_tokens()[0, fact].all())
    assert int(banded.chosen_tokens()[0].sum()) == 8
    # the importance the banded guard ranks: level 1 everywhere but the fact (about 3)
    imp = token_importance(states, 96)
    rel = band_relative(imp, ~already, 32)[0]
    assert float(rel[8:16].min()) > 2.5 and float(rel[16:].max()) < 1.2


def test_band_zero_is_the_guard_without_it():
    states = _biased_layers(seed=4)
    budget, already = torch.tensor([40]), torch.zeros(1, 96, dtype=torch.bool)
    already[:, :2] = True
    a, b = ImportanceGuard(share=0.5, band=0), ImportanceGuard(share=0.5)
    a.prepare(states, budget, already)
    b.prepare(states, budget, already)
    assert torch.equal(a.chosen_tokens(), b.chosen_tokens())
    assert "band" not in get_preset("kvzip-copy-heads-fitted").guards[0].params  # its grids stand


@pytest.mark.parametrize("bad", [-1, 1.5, True, "512"])
def test_bad_band_is_named(bad):
    with pytest.raises(ValueError, match="band"):
        ImportanceGuard(band=bad)


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.75])  # above 0.25 its allowance_keep caps the allowances
def test_banded_preset_meets_the_budget_exactly(keep):
    gen = torch.Generator().manual_seed(1)
    N, B, H, W = 256, 2, 3, 16
    ids = torch.randint(0, len(VOCAB), (B, N), generator=gen)
    states = []
    for layer in range(3):
        s = make_state(layer, B=B, H=H, N=N, vocab=VOCAB, with_membership=False)
        states.append(s.replace(token_ids=ids, stats={"reconstruction": torch.rand(B, H, N, generator=gen)},
                                extras={COPY: torch.rand(B, H, generator=gen),
                                        "surprisal": torch.rand(B, N, generator=gen),
                                        "queries": torch.randn(B, H, W, s.head_dim, generator=gen)}))
    cfg = get_preset("kvzip-copy-heads-banded", keep_ratio=keep, on_infeasible="error")
    cfg = cfg.replace(guards=({"name": "importance", "params": {**cfg.guards[0].params, "band": 64,
                                                                 "ends": [".", "!"]}},))
    pipe = Pipeline(cfg)
    pipe.prepare(states)
    assert pipe.guards[0].band == 64
    assert int(pipe.guards[0].chosen_tokens().sum()) > 0
    for layer, s in enumerate(states):
        out, report = pipe.compress(s, layer_idx=layer)
        assert report.budget_met
        assert bool((out.valid.sum(-1) == int(N * keep)).all())
    sid = sentence_ids(ids, VOCAB, (".", "!"))
    keep_tokens = pipe.guards[0].chosen_tokens()
    for b in range(B):  # whole sentences only
        for s_ in sid[b][keep_tokens[b]].unique().tolist():
            assert bool(keep_tokens[b][sid[b] == s_].all())
