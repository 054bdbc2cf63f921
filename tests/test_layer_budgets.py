"""Budgets split over the layers (``LayerBudgetGuard``; the importance guard's ``copy_layer_scale``,
preset ``kvzip-copy-heads-layers``): the factors average 1 over the layers, each layer meets its own
share exactly, the cache's size is the budget's, the share is carried by the layer's state to every
later compression (decode time, another pipeline instance), and the eval's and the API's budget
checks read the cache's size and every layer's share."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state
from kvcompress.api import keep_summary
from kvcompress.budget import LAYER_SCALE, target_slots
from kvcompress.decode import DecodeCompressor, append_tokens
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.protocols import LayerBudgetGuard
from kvcompress.strategies.importance import COPY, MIN_LAYER_SCALE, ImportanceGuard, split_layers

from test_eval_helpers import TEXT, model, one_thread, tiny_model, tiny_tokenizer, tok  # noqa: F401  (fixtures)

VOCAB = ("a", " b", " c", ".", " d", " e", "!", " f")


def _layers(L=6, H=3, N=240, B=2, seed=0, copy_layers=(1, 4)):
    """L layer states of one sequence with reconstruction statistics; the copy score is highest in
    one head of each layer of ``copy_layers`` (for every row), so those are the copy layers."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(VOCAB), (B, N), generator=gen)
    out = []
    for layer in range(L):
        stt = make_state(seed + layer, B=B, H=H, N=N, vocab=VOCAB, with_membership=False)
        copy = torch.rand(B, H, generator=gen) * 0.5
        if layer in copy_layers:
            copy[:, layer % H] = 1.0 + layer  # above every other head's
        out.append(stt.replace(token_ids=ids, stats={"reconstruction": torch.rand(B, H, N, generator=gen)},
                               extras={COPY: copy, "surprisal": torch.rand(B, N, generator=gen),
                                       "queries": torch.randn(B, H, 32, stt.head_dim, generator=gen)}))
    return out


@settings(CORE_SETTINGS, max_examples=200)
@given(c=st.integers(0, 40), L=st.integers(1, 40), scale=st.floats(1.0, 8.0))
def test_split_averages_one_and_keeps_the_floor(c, L, scale):
    split = split_layers(c, L, scale)
    if c == 0 or c >= L:
        assert split is None
        return
    hi, lo = split
    assert 1.0 <= hi <= scale + 1e-12 and MIN_LAYER_SCALE - 1e-12 <= lo <= 1.0
    assert math.isclose(c * hi + (L - c) * lo, L, rel_tol=1e-12)
    if (L - c * scale) / (L - c) >= MIN_LAYER_SCALE:
        assert hi == scale  # lowered only when the others would keep less than the floor


@settings(CORE_SETTINGS, max_examples=100)
@given(n=st.integers(1, 5000), keep=st.floats(0.01, 1.0), scale=st.floats(0.5, 4.0))
def test_scaled_budget_rule_is_the_even_rule_at_scale_one(n, keep, scale):
    real = torch.tensor([n, max(n // 3, 1)])
    one = torch.ones(2, dtype=torch.float64)
    assert torch.equal(target_slots(real, keep, None, one), target_slots(real, keep, None))
    got = target_slots(real, keep, None, one * scale)
    expect = torch.tensor([max(1, math.floor(int(r) * keep * scale + 1e-9)) for r in real])
    assert torch.equal(got, expect)
    assert torch.equal(target_slots(real, None, 40, one * scale), torch.full((2,), max(1, math.floor(40 * scale + 1e-9))))


def test_bad_copy_layer_scale_names_the_parameter():
    for bad in (0.5, 9.0, float("nan"), "2"):
        with pytest.raises(ValueError, match="copy_layer_scale"):
            ImportanceGuard(copy_heads=0.1, copy_layer_scale=bad)
    with pytest.raises(ValueError, match="copy_layer_scale"):
        ImportanceGuard(copy_heads=1.0, copy_layer_scale=2.0)
    cfg = get_preset("kvzip-copy-heads-layers")
    (guard,) = cfg.guards
    with pytest.raises(ValueError, match="copy_layer_scale"):  # through a config, before any compression
        Pipeline(cfg.replace(guards=({"name": guard.name, "params": {**guard.params, "copy_layer_scale": 0.0}},)))


@pytest.mark.parametrize("keep", [0.25, 0.5])
def test_each_layer_meets_its_share_and_the_cache_the_budget(keep):
    """Through the preset's pipeline: the copy layers keep floor(T * keep * hi) slots per head, the
    others floor(T * keep * lo), the total is at most L * floor(T * keep), the share is carried in
    the compressed state, and a second compression of a compressed state (another pipeline
    instance, never prepared) keeps the layer at its share."""
    L, N = 6, 240
    states = _layers(L=L, N=N)
    cfg = get_preset("kvzip-copy-heads-layers", keep_ratio=keep, on_infeasible="error")
    pipe = Pipeline(cfg)
    assert isinstance(pipe.guards[0], LayerBudgetGuard)
    pipe.prepare(states)
    # 6 layers x 3 heads, copy_heads 0.05: the one head with the highest copy score per row
    hi, lo = split_layers(1, L, 2.0)
    total, outs = 0, []
    for layer, stt in enumerate(states):
        out, report = pipe.compress(stt, layer_idx=layer)
        assert report.budget_met
        factor = hi if layer == 4 else lo
        expect = max(1, math.floor(N * keep * factor + 1e-9))
        assert bool((out.valid.sum(-1) == expect).all()), (layer, out.valid.sum(-1), expect)
        assert torch.allclose(out.extras[LAYER_SCALE], torch.full((2,), factor, dtype=torch.float64))
        total += expect
        outs.append(out)
    assert total <= L * math.floor(N * keep)
    fresh = Pipeline(cfg)  # its guard never prepared: the carried share decides
    for layer, out in enumerate(outs):
        again, report = fresh.compress(out, layer_idx=layer)
        assert report.budget_met and torch.equal(again.valid.sum(-1), out.valid.sum(-1))


def test_decode_time_compression_keeps_each_layer_at_its_share():
    """After g appended tokens the decode rule compresses a layer back to ITS share (the copy
    layer is not squeezed to an even split, the others not left above theirs)."""
    L, N = 6, 240
    states = _layers(L=L, N=N)
    cfg = get_preset("kvzip-copy-heads-layers", keep_ratio=0.25, on_infeasible="best_effort", recompress_every=8)
    pipe = Pipeline(cfg)
    pipe.prepare(states)
    dec = DecodeCompressor(pipe)
    hi, lo = split_layers(1, L, 2.0)
    gen = torch.Generator().manual_seed(5)
    for layer, stt in enumerate(states):
        out, _ = pipe.compress(stt, layer_idx=layer)
        q = 20  # past budget + g in every layer (a copy layer's budget grows by 0.5 a token)
        keys = torch.randn(2, 3, q, stt.head_dim, generator=gen)
        grown = append_tokens(out, keys, torch.randn(2, 3, q, stt.head_dim, generator=gen),
                              torch.zeros(2, q, dtype=torch.long))
        assert dec.should_compress(grown, layer)
        again, report = dec.compress(grown, layer)
        factor = hi if layer == 4 else lo
        assert bool((again.valid.sum(-1) == max(1, math.floor((N + q) * 0.25 * factor + 1e-9))).all())


def test_one_layer_alone_and_an_even_guard_carry_no_share():
    """Prepared from one layer (every layer it saw is a copy layer) or with copy_layer_scale 1, the
    budget is the even one and no share is written."""
    states = _layers(L=6)
    pipe = Pipeline(get_preset("kvzip-copy-heads-layers", keep_ratio=0.25, on_infeasible="error"))
    out, _ = pipe.compress(states[4], layer_idx=4)  # prepared from this layer alone
    assert LAYER_SCALE not in out.extras and bool((out.valid.sum(-1) == 60).all())
    even = Pipeline(get_preset("kvzip-copy-heads-noquery", keep_ratio=0.25, on_infeasible="error"))
    even.prepare(states)
    for layer, stt in enumerate(states):
        out, _ = even.compress(stt, layer_idx=layer)
        assert LAYER_SCALE not in out.extras and bool((out.valid.sum(-1) == 60).all())


def test_keep_summary_reads_the_cache_size_and_each_layers_share():
    cfg = {"keep_ratio": 0.25, "sinks": 4, "recent": 32}
    base = {"context_tokens": 1000, "pipeline": cfg}
    even = keep_summary({**base, "slots_per_layer": [250] * 4})
    assert even["budget_met"] and even["keep_total"] == 0.25
    split = keep_summary({**base, "slots_per_layer": [500, 166, 166, 166],
                          "budget_scale_per_layer": [2.0, 2 / 3, 2 / 3, 2 / 3]})
    assert split["budget_met"] and split["keep_reached"] == 0.5 and split["keep_total"] <= 0.25
    over_share = keep_summary({**base, "slots_per_layer": [500, 200, 100, 100],
                               "budget_scale_per_layer": [2.0, 2 / 3, 2 / 3, 2 / 3]})
    assert not over_share["budget_met"]  # total 900 <= 1000, but layer 1 above its share
    no_share = keep_summary({**base, "slots_per_layer": [500, 166, 166, 166]})
    assert not no_share["budget_met"]  # without a split the even budget holds for every layer


def test_generate_meets_the_budget_as_the_cache_size(model, tok):
    """Through transformers on a tiny model: the report carries each layer's share, the eval's
    keep_reached reads the cache's size within the budget, every layer within its share."""
    import kvcompress
    from kvcompress.eval.caches import keep_reached
    from kvcompress.hf import CompressedCache

    res = kvcompress.generate(model, tok, TEXT, "kvzip-copy-heads-layers", budget=0.25, max_new_tokens=3,
                              question="What is", backend="sdpa", recent=8)
    r = res.report
    scales = r["budget_scale_per_layer"]
    assert r["budget_met"], r.get("budget_note")
    assert len(scales) == len(r["slots_per_layer"]) and max(scales) > 1 > min(scales)
    assert math.isclose(sum(scales), len(scales), rel_tol=1e-6, abs_tol=1e-5)
    assert r["keep_total"] <= 0.25 + 1e-9 and r["keep_reached"] > 0.25
    cache = CompressedCache.for_model(model, tok, "kvzip-copy-heads-layers", keep_ratio=0.25, backend="sdpa", recent=8)
    try:
        ids = tok(TEXT, return_tensors="pt")["input_ids"]
        cache.prefill(ids)
        mean, worst, met, total = keep_reached(cache)
        assert met and worst <= 0.25 + 1e-9 and total <= 0.25 + 1e-9 and mean <= 0.25 + 1e-9
    finally:
        cache.close()


def test_decoding_through_the_cache_keeps_each_layer_at_its_share(model, tok):
    """Token by token over a compressed cache (recompress_every 4): every layer stays within its
    own share + g, the copy layer above an even split's budget (never squeezed back to it), and a
    deep copy (one document, many questions) carries the shares."""
    import copy

    from kvcompress.hf import CompressedCache

    g = 4
    cache = CompressedCache.for_model(model, tok, "kvzip-copy-heads-layers", keep_ratio=0.25, backend="sdpa",
                                      recent=8, recompress_every=g)
    try:
        ids = tok(TEXT, return_tensors="pt")["input_ids"]
        cache.prefill(ids)
        shares = cache.budget_scale_per_layer()
        assert max(shares) > 1 > min(shares)
        twin = copy.deepcopy(cache)
        assert twin.budget_scale_per_layer() == shares
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for step in range(3 * g + 1):
                nxt = torch.randint(0, 200, (1, 1), generator=gen)
                mask = torch.ones(1, cache.num_tokens + 1, dtype=torch.long)
                model(input_ids=nxt, attention_mask=mask, cache=cache)
                T = cache.num_tokens
                for i, share in zip(cache.compressed_layer_ids(), shares):
                    held = int(cache.layers[i].valid_slots().max())
                    assert held <= max(1, math.floor(T * 0.25 * share + 1e-9)) + g, (step, i, held)
        assert cache.stats["decode_compressions"] > 0
        assert cache.budget_scale_per_layer() == shares
        wide = [i for i, s in zip(cache.compressed_layer_ids(), shares) if s > 1]
        assert all(int(cache.layers[i].valid_slots().min()) > math.floor(cache.num_tokens * 0.25) for i in wide)
        twin.close()
    finally:
        cache.close()


def test_two_guards_that_could_split_may_coexist_while_at_most_one_splits():
    """Every importance guard can split the budget, but only one with copy_layer_scale > 1 may do
    so in a pipeline: two guards at scale 1 compress as before; two splitting ones are refused
    with an error naming the guards, before the state is changed."""
    states = _layers(L=6)
    cfg = get_preset("kvzip-copy-heads-layers", keep_ratio=0.25, on_infeasible="error")
    (guard,) = cfg.guards
    even = {"name": guard.name, "params": {**guard.params, "copy_layer_scale": 1.0}}
    pipe = Pipeline(cfg.replace(guards=(even, even)))
    pipe.prepare(states)
    out, _ = pipe.compress(states[4], layer_idx=4)
    assert LAYER_SCALE not in out.extras and bool((out.valid.sum(-1) == 60).all())
    split = {"name": guard.name, "params": dict(guard.params)}
    twice = Pipeline(cfg.replace(guards=(split, split)))
    twice.prepare(states)
    before = states[4].keys.clone()
    with pytest.raises(ValueError, match="at most one guard"):
        twice.compress(states[4], layer_idx=4)
    assert torch.equal(states[4].keys, before) and LAYER_SCALE not in states[4].extras


def free_lengths(sid, already) -> dict[int, int]:
    """Slow reference: tokens of each sentence (``sid`` [T]) not in ``already`` [T] bool."""
    lengths: dict[int, int] = {}
    for t in range(sid.shape[0]):
        if not already[t]:
            lengths[int(sid[t])] = lengths.get(int(sid[t]), 0) + 1
    return lengths


def assert_greedy_fill(lengths: dict[int, int], picked: set, candidates: set, allowance: int) -> None:
    """No candidate sentence left out of ``picked`` would still fit what the allowance leaves (the
    greedy choice skips only sentences longer than what is left, and what is left only shrinks)."""
    used = sum(lengths.get(s, 0) for s in picked)
    left_out = [lengths[s] for s in candidates - picked if s in lengths]
    assert all(n > allowance - used for n in left_out), (allowance, used, sorted(left_out)[:3])


def _sentence_guard(scale: float, layer_scale: float = 2.0) -> ImportanceGuard:
    (guard,) = get_preset("kvzip-copy-heads-layers").guards
    return ImportanceGuard(**{**guard.params, "copy_layer_scale": layer_scale, "copy_sentence_scale": scale})


def test_bad_copy_sentence_scale_names_the_parameter():
    for bad in (0.5, 9.0, float("nan"), "2"):
        with pytest.raises(ValueError, match="copy_sentence_scale"):
            _sentence_guard(bad)
    with pytest.raises(ValueError, match="copy_sentence_scale=3.*at most copy_layer_scale = 2"):
        _sentence_guard(3.0, layer_scale=2.0)
    cfg = get_preset("kvzip-copy-heads-layers")
    (guard,) = cfg.guards
    with pytest.raises(ValueError, match="copy_sentence_scale"):  # through a config, before any compression
        Pipeline(cfg.replace(guards=({"name": guard.name, "params": {**guard.params, "copy_sentence_scale": 2.5}},)))


@settings(CORE_SETTINGS, max_examples=12)
@given(scale=st.floats(1.0, 2.0), keep=st.sampled_from([0.25, 0.4]), seed=st.integers(0, 50))
def test_sentence_scale_fills_the_scaled_allowance_and_no_more(scale, keep, seed):
    """The chosen sentences' free tokens fit floor(room * share * scale) (room: the budget at keep
    0.25 at most, less the protected slots), and no sentence left out would still fit (a slow
    check, sentence by sentence); the quotas of the heads without sentences are an even split's."""
    from kvcompress.strategies.sentences import sentence_ids

    L, N, B = 6, 240, 2
    states = _layers(L=L, N=N, B=B, seed=seed)
    guard, even = _sentence_guard(scale), _sentence_guard(1.0)
    budget = torch.full((B,), math.floor(N * keep))
    already = torch.zeros(B, N, dtype=torch.bool)
    already[:, :4] = True
    already[:, -32:] = True
    guard.prepare(states, budget, already)
    even.prepare(states, budget, already)
    room = min(math.floor(N * keep), math.floor(N * 0.25)) - 36
    allowance = math.floor(room * (guard.share * min(scale, split_layers(1, L, 2.0)[0])))  # one copy head: as the guard computes it
    sid = sentence_ids(states[0].token_ids, VOCAB, guard.ends)
    chosen = guard.chosen_tokens()
    for b in range(B):
        lengths = free_lengths(sid[b], already[b])
        picked = {int(sid[b, t]) for t in range(N) if chosen[b, t]}
        used = sum(lengths.get(s, 0) for s in picked)
        assert used <= allowance
        assert_greedy_fill(lengths, picked, set(lengths), allowance)
    assert torch.equal(guard._other, even._other) and torch.equal(guard._allowance, even._allowance)
    if scale == 1.0:
        assert torch.equal(chosen, even.chosen_tokens())


@pytest.mark.parametrize("scale", [1.5, 2.0])
def test_scaled_sentences_keep_every_layer_at_its_share(scale):
    """Through a pipeline: each layer keeps exactly its share, the copy heads hold every chosen
    sentence token (more of them than at scale 1), the other heads none of them."""
    L, N = 6, 240
    states = _layers(L=L, N=N)
    cfg = get_preset("kvzip-copy-heads-layers", keep_ratio=0.25, on_infeasible="error")
    (guard,) = cfg.guards
    held = {}
    for s in (1.0, scale):
        pipe = Pipeline(cfg.replace(guards=({"name": guard.name, "params": {**guard.params, "copy_sentence_scale": s}},)))
        pipe.prepare(states)
        hi, lo = split_layers(1, L, 2.0)
        chosen = pipe.guards[0].chosen_tokens()
        for layer, stt in enumerate(states):
            out, report = pipe.compress(stt, layer_idx=layer)
            factor = hi if layer == 4 else lo
            assert report.budget_met
            assert bool((out.valid.sum(-1) == max(1, math.floor(N * 0.25 * factor + 1e-9))).all())
            if layer == 4:
                pos = torch.where(out.valid, out.positions, -1)  # a kept token's slot (D2O may merge into it)
                for b in range(2):
                    want = set(torch.nonzero(chosen[b]).flatten().tolist())
                    copy_head = 4 % 3
                    assert want <= set(pos[b, copy_head].tolist())
        held[s] = int(chosen.sum())
    assert held[scale] > held[1.0]
