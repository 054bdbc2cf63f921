"""The reconstruction pass's per-head copy score (against a full-attention reference on a tiny
random Llama) and the importance guard's copy-head split (sentences only in the heads that copy,
per-head budgets summing to the layer's budget)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state
from kvcompress.hf.reconstruct import COPY_KEY, reconstruction_scores
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies.importance import COPY, ImportanceGuard, copy_of

from test_eval_helpers import TEXT, model, one_thread, tiny_model, tiny_tokenizer, tok  # noqa: F401  (fixtures)
from test_reconstruct import prefill_kv, tiny_llama

VOCAB = ("a", " b", " c", ".", " d", " e", "!", " f")


def reference_copy(model, ctx, repeat, chunk):
    """Per layer [B, H]: for each chunk a fresh eager forward over context + repeat + chunk; for
    every context query j of the chunk (token s + j), the attention on cached columns s+j-1..s+j+1
    (those inside the context), mean over the group's query heads, then mean over all queries."""
    B, T = ctx.shape
    H = model.config.num_key_value_heads
    G = model.config.num_attention_heads // H
    P = repeat.shape[1]
    total = [torch.zeros(B, H) for _ in model.model.layers]
    count = 0
    for s in range(0, T, chunk):
        piece = ctx[:, s:s + chunk]
        ids = torch.cat([ctx, repeat.expand(B, -1), piece], dim=1)
        with torch.no_grad():
            att = model(input_ids=ids, output_attentions=True).attentions
        for j in range(piece.shape[1]):
            row = T + P + j
            cols = [c for c in (s + j - 1, s + j, s + j + 1) if 0 <= c < T]
            for layer, a in enumerate(att):  # [B, Hq, L, L]
                mass = a[:, :, row, cols].sum(-1)  # [B, Hq]
                total[layer] += mass.view(B, H, G).mean(-1)
        count += piece.shape[1]
    return [t / count for t in total]


@pytest.mark.parametrize("chunk", [5, 64])
def test_copy_score_equals_full_attention_reference(chunk):
    model = tiny_llama()
    gen = torch.Generator().manual_seed(4)
    ctx = torch.randint(0, 50, (2, 13), generator=gen)
    repeat = torch.randint(0, 50, (1, 3), generator=gen)
    got = reconstruction_scores(model, prefill_kv(model, ctx), ctx, repeat_ids=repeat, chunk=chunk)
    ref = reference_copy(model, ctx, repeat, chunk)
    assert len(got.copy) == len(ref)
    for g, r in zip(got.copy, ref):
        assert g.shape == r.shape == (2, 2)
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
        assert bool((g >= 0).all() and (g <= 1 + 1e-6).all())


def test_copy_score_of_a_repeated_text_is_higher_in_the_heads_that_copy():
    """Sanity on the meaning: a head whose queries attend to their own aligned slot scores 1-ish,
    a layer not scored has None."""
    model = tiny_llama()
    ctx = torch.randint(0, 50, (1, 12))
    repeat = torch.randint(0, 50, (1, 2))
    part = reconstruction_scores(model, prefill_kv(model, ctx), ctx, repeat_ids=repeat, chunk=4, layers=[1])
    assert part.copy[0] is None and part.copy[2] is None and part.copy[1].shape == (1, 2)


def _layers(L=3, H=4, N=64, seed=0):
    """L layer states whose copy scores are known: head h of layer l scores (l * H + h) / (L * H)."""
    ids = torch.randint(0, len(VOCAB), (1, N), generator=torch.Generator().manual_seed(seed))
    out = []
    for layer in range(L):
        stt = make_state(layer + seed, B=1, H=H, N=N, vocab=VOCAB, with_membership=False)
        score = torch.rand(1, H, N, generator=torch.Generator().manual_seed(seed * 31 + layer))
        copy = (layer * H + torch.arange(H, dtype=torch.float32))[None] / (L * H)
        out.append(stt.replace(token_ids=ids, stats={"reconstruction": score}, extras={COPY: copy}))
    return out


def test_sentences_only_in_the_highest_copy_heads():
    states = _layers()
    budget = torch.tensor([32])
    already = torch.zeros(1, 64, dtype=torch.bool)
    guard = ImportanceGuard(share=0.5, token_share=0.0, copy_heads=0.25, other_token_share=0.25)
    guard.prepare(states, budget, already)
    chosen = guard.chosen_tokens()[0]
    assert int(chosen.sum()) > 0
    for layer, stt in enumerate(states):
        mask = guard(stt)[0]  # [H, N]
        for h in range(4):
            high = layer * 4 + h >= 9  # the top ceil(0.25 * 12) = 3 of 12 pairs
            pos = stt.positions[0, h]
            if high:  # the sentences, nothing else (token_share 0)
                assert torch.equal(mask[h], chosen[pos]), (layer, h)
            else:  # its own best 8 tokens by reconstruction score, no sentence unless among them
                best = set(stt.stats["reconstruction"][0, h].topk(8).indices.tolist())
                assert set(mask[h].nonzero().flatten().tolist()) == best, (layer, h)
    # copy_heads=1 reads no copy score and gives every head the sentences
    full = ImportanceGuard(share=0.5)
    full.prepare([s.replace(extras={}) for s in states], budget, already)
    assert bool(full(states[0].replace(extras={}))[0].eq(chosen[states[0].positions[0]]).all())


@settings(CORE_SETTINGS, max_examples=15)  # each example compresses 3 layers of 256 slots
@given(seed=st.integers(0, 10_000), keep=st.sampled_from([0.25, 0.5]), heads=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
       other=st.sampled_from([None, 0.0, 0.5, 0.9]))
def test_copy_head_budgets_sum_to_the_layer_budget(seed, keep, heads, other):
    """Through the pipeline: every head keeps exactly its budget (a rectangular layer, so the heads'
    budgets sum to the layer's), and no head protects more exact tokens than the budget allows."""
    gen = torch.Generator().manual_seed(seed)
    L, H, N = 3, 3, 256
    states = []
    ids = torch.randint(0, len(VOCAB), (2, N), generator=gen)
    for layer in range(L):
        stt = make_state(seed + layer, B=2, H=H, N=N, vocab=VOCAB, with_membership=False)
        states.append(stt.replace(token_ids=ids, stats={"reconstruction": torch.rand(2, H, N, generator=gen)},
                                  extras={COPY: torch.rand(2, H, generator=gen),
                                          "surprisal": torch.rand(2, N, generator=gen),
                                          "queries": torch.randn(2, H, 16, stt.head_dim, generator=gen)}))
    guard = {"name": "importance", "params": {"share": 0.8, "token_share": 0.15, "reduce": "median",
                                              "surprisal": 1.0, "head_budget": "adaptive",
                                              "copy_heads": heads, "other_token_share": other}}
    cfg = get_preset("kvzip-copy-heads", keep_ratio=keep, on_infeasible="error", guards=[guard])
    pipe = Pipeline(cfg)
    pipe.prepare(states)
    budget = int(N * keep)
    g = pipe.guards[0]
    for layer, stt in enumerate(states):
        marked = g(stt).sum(-1)  # [B, H] exact tokens the guard asks for
        assert bool((marked <= budget).all()), marked
        out, report = pipe.compress(stt, layer_idx=layer)
        assert report.budget_met
        slots = out.valid.sum(-1)
        assert bool((slots == budget).all()), slots
        assert torch.equal(slots.sum(-1), torch.full((2,), H * budget))


def test_preset_declares_its_needs_and_copy_errors():
    pipe = Pipeline(get_preset("kvzip-copy-heads"))
    assert pipe.needs.model_pass and pipe.needs.surprisal
    stt = make_state(0, B=1, H=2, N=16, vocab=VOCAB, with_membership=False)
    with pytest.raises(ValueError, match="reconstruction_copy"):
        copy_of(stt)
    with pytest.raises(ValueError, match="reconstruction_copy"):
        copy_of(stt.replace(extras={COPY: torch.zeros(1, 3)}))
    scored = stt.replace(stats={"reconstruction": torch.rand(1, 2, 16)})
    with pytest.raises(ValueError, match="reconstruction_copy"):
        ImportanceGuard(copy_heads=0.5).prepare([scored], torch.tensor([4]), torch.zeros(1, 16, dtype=torch.bool))
    for bad in (0.0, 1.5, -1, "x"):
        with pytest.raises(ValueError, match="copy_heads"):
            ImportanceGuard(copy_heads=bad)
    for bad in (-0.1, 1.2, "x"):
        with pytest.raises(ValueError, match="other_token_share"):
            ImportanceGuard(copy_heads=0.5, other_token_share=bad)
    with pytest.raises(ValueError, match="other_token_share"):
        ImportanceGuard(window_share=0.5, copy_heads=0.5, other_token_share=0.6)
    assert COPY_KEY == COPY


def test_live_cache_and_eval_carry_the_same_copy_scores(model, tok):
    """The prefill hook (live cache) and the eval's pass write the copy scores of a pass computed
    apart; the preset runs through generate with its budget met."""
    import kvcompress
    from kvcompress.eval.caches import Recorder
    from kvcompress.eval.methods import Method
    from kvcompress.eval.reconstruction import attach_reconstruction
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg
    from kvcompress.hf.reconstruct import prefill_hook, repeat_prompt_ids

    ids = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"][:70]])
    live = CompressedCache.for_model(model, tok, None, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): live})
    states = live.states()
    ref = reconstruction_scores(model, states, ids, repeat_ids=repeat_prompt_ids(tok)).copy
    prefill_hook(tok)(live, model)
    hooked = [st.extras[COPY_KEY] for st in live.states()]
    live.close()
    rec = Recorder.for_configs(model, tok, [Method.parse("kvzip-copy-heads").config(0.25)], backend="sdpa")
    try:
        rec.feed(ids)
        snap = rec.snapshot()
    finally:
        rec.close()
    attach_reconstruction(model, tok, snap, surprisal=True)
    for r, h, st_ in zip(ref, hooked, snap.states):
        torch.testing.assert_close(h, r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st_.extras[COPY_KEY], r, rtol=1e-5, atol=1e-6)
    res = kvcompress.generate(model, tok, TEXT, "kvzip-copy-heads", budget=0.25, max_new_tokens=3,
                              question="What is", backend="sdpa", recent=8)
    assert res.report["budget_met"], res.report.get("budget_note")
