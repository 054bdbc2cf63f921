"""The reconstruction pass equals a direct computation with the full attention matrix."""

from __future__ import annotations

import pytest
import torch

from kvcompress.hf.reconstruct import reconstruction_scores
from kvcompress.types import KVState

transformers = pytest.importorskip("transformers")


def tiny_llama(layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    return model


def prefill_kv(model, ids):
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def reference(model, ctx, repeat, chunk, starts=None, lead=0, aligned=False):
    """Per layer [B, H, T]: for each chunk, a fresh full forward over context + repeat (+ the lead
    context tokens before the chunk) + chunk with eager attention; max over the pass's queries and
    the group's heads of the full softmax. aligned: the pass's tokens at the positions one full
    repeat would give them (the chunk's token i at T + P + s + i), capped at the model's limit."""
    B, T = ctx.shape
    H = model.config.num_key_value_heads
    G = model.config.num_attention_heads // H
    out = [torch.zeros(B, H, T) for _ in model.model.layers]
    starts = list(range(0, T, chunk)) if starts is None else starts
    for s in starts:
        ids = torch.cat([ctx, repeat.expand(B, -1), ctx[:, max(0, s - lead):s], ctx[:, s:s + chunk]], dim=1)
        L = ids.shape[1]
        shift = s - min(lead, s) if aligned else 0
        shift = max(0, min(shift, model.config.max_position_embeddings - L))
        pos = torch.cat([torch.arange(T), torch.arange(T + shift, L + shift)])[None].expand(B, -1)
        with torch.no_grad():
            att = model(input_ids=ids, position_ids=pos, output_attentions=True).attentions
        for layer, a in enumerate(att):  # a: [B, Hq, L, L]
            rows = a[:, :, T:, :T]  # queries of the pass, cached columns
            per_kv = rows.reshape(B, H, G, rows.shape[2], T).amax(dim=(2, 3))
            out[layer] = torch.maximum(out[layer], per_kv)
    return out


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_scores_equal_full_attention_reference(chunk):
    model = tiny_llama()
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 50, (2, 19), generator=gen)
    repeat = torch.randint(0, 50, (1, 3), generator=gen)
    kv = prefill_kv(model, ctx)
    got = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=chunk)
    ref = reference(model, ctx, repeat, chunk)
    assert model.config._attn_implementation == "eager"  # restored
    for g, r in zip(got.scores, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    assert got.chunks == -(-19 // chunk)
    assert got.tokens == sum(3 + min(chunk, 19 - s) for s in range(0, 19, chunk))


@pytest.mark.parametrize("chunk, lead", [(4, 2), (7, 7), (5, 30)])
def test_a_lead_in_before_each_chunk_equals_the_reference_with_it(chunk, lead):
    model = tiny_llama()
    gen = torch.Generator().manual_seed(2)
    ctx = torch.randint(0, 50, (2, 19), generator=gen)
    repeat = torch.randint(0, 50, (1, 3), generator=gen)
    kv = prefill_kv(model, ctx)
    got = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=chunk, lead=lead)
    for g, r in zip(got.scores, reference(model, ctx, repeat, chunk, lead=lead)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    # the lead-in changes what the chunk's own queries see, so their copy mass differs from the plain
    # pass's (the scores may not: a random model's diffuse maxima come from the repeat prompt's queries)
    plain = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=chunk)
    assert all(not torch.allclose(g, p, atol=1e-4) for g, p in zip(got.copy, plain.copy))
    assert got.tokens == sum(3 + min(lead, s) + min(chunk, 19 - s) for s in range(0, 19, chunk))
    assert got.meta["lead"] == lead


@pytest.mark.parametrize("chunk, lead, limit", [(4, 0, 256), (5, 2, 256), (7, 7, 256), (4, 2, 30)])
def test_aligned_chunks_equal_the_reference_at_full_repeat_positions(chunk, lead, limit):
    """aligned=True: every chunk at the positions one full repeat gives it (limit 30 < T + P + T = 41:
    the later chunks shift less, no position past the model's max_position_embeddings)."""
    model = tiny_llama()
    model.config.max_position_embeddings = limit
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 50, (2, 19), generator=gen)
    repeat = torch.randint(0, 50, (1, 3), generator=gen)
    kv = prefill_kv(model, ctx)
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(int(kw["position_ids"].max())),
                                                 with_kwargs=True)
    try:
        got = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=chunk, lead=lead, aligned=True)
    finally:
        hook.remove()
    assert max(seen) <= limit - 1 and (limit < 41 or max(seen) == 19 + 3 + 18)
    for g, r in zip(got.scores, reference(model, ctx, repeat, chunk, lead=lead, aligned=True)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    plain = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=chunk, lead=lead)
    assert all(not torch.allclose(g, p, atol=1e-5) for g, p in zip(got.scores, plain.scores))
    assert got.meta["aligned"] is True and plain.meta["aligned"] is False
    with pytest.raises(ValueError, match="aligned"):
        reconstruction_scores(model, kv, ctx, repeat_ids=repeat, aligned=1)


def test_states_bias_and_layers_subset():
    model = tiny_llama()
    gen = torch.Generator().manual_seed(2)
    ctx = torch.randint(0, 50, (1, 12), generator=gen)
    repeat = torch.randint(0, 50, (1, 2), generator=gen)
    kv = prefill_kv(model, ctx)
    states = [KVState.from_raw(k, v) for k, v in kv]
    full = reconstruction_scores(model, states, ctx, repeat_ids=repeat, chunk=5)
    part = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=5, layers=[1])
    assert part.scores[0] is None and part.scores[2] is None
    torch.testing.assert_close(part.scores[1], full.scores[1])


def test_subsample_feeds_fewer_chunks_and_matches_reference_on_them():
    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 50, (1, 40), generator=gen)
    repeat = torch.randint(0, 50, (1, 2), generator=gen)
    kv = prefill_kv(model, ctx)
    got = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=8, subsample=0.4)
    assert got.chunks == 2
    ref = reference(model, ctx, repeat, 8, starts=[0, 32])
    for g, r in zip(got.scores, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_query_samples_strided():
    model = tiny_llama()
    ctx = torch.randint(0, 50, (1, 30))
    repeat = torch.randint(0, 50, (1, 2))
    kv = prefill_kv(model, ctx)
    got = reconstruction_scores(model, kv, ctx, repeat_ids=repeat, chunk=10, query_samples=6)
    for q in got.queries:
        assert q.shape == (1, 4, 6, 8)


def test_bad_inputs():
    model = tiny_llama()
    ctx = torch.randint(0, 50, (1, 6))
    kv = prefill_kv(model, ctx)
    rep = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="model"):
        reconstruction_scores(None, kv, ctx, repeat_ids=rep)
    with pytest.raises(ValueError, match="context_ids"):
        reconstruction_scores(model, kv, ctx[:, :0], repeat_ids=rep)
    with pytest.raises(ValueError, match="states_or_kv"):
        reconstruction_scores(model, kv[:1], ctx, repeat_ids=rep)
    with pytest.raises(ValueError, match="repeat_ids"):
        reconstruction_scores(model, kv, ctx, repeat_ids=rep[:, :0])
    with pytest.raises(ValueError, match="subsample"):
        reconstruction_scores(model, kv, ctx, repeat_ids=rep, subsample=0.0)
    with pytest.raises(ValueError, match="layers"):
        reconstruction_scores(model, kv, ctx, repeat_ids=rep, layers=[7])
    with pytest.raises(ValueError, match="lead=-1"):
        reconstruction_scores(model, kv, ctx, repeat_ids=rep, lead=-1)
    assert model.config._attn_implementation == "eager"


# ---------------------------------------------------------------------------- surprisal
def reference_prefill_surprisal(model, ids):
    """[B, T]: -log softmax of a plain full forward's logits at t - 1, read at ids[t]; 0 at t = 0."""
    with torch.no_grad():
        logp = model(input_ids=ids).logits.float().log_softmax(-1)
    out = torch.zeros(ids.shape, dtype=torch.float32)
    out[:, 1:] = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return out


def test_prefill_surprisal_equals_a_full_forward():
    from kvcompress.hf.reconstruct import prefill_surprisal

    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 23), generator=gen)
    got = prefill_surprisal(model, ids)
    torch.testing.assert_close(got, reference_prefill_surprisal(model, ids), atol=1e-4, rtol=1e-4)
    assert got.shape == (2, 23) and float(got[:, 0].abs().max()) == 0.0 and bool((got[:, 1:] > 0).all())
    assert model.config._attn_implementation == "eager"  # restored


def test_prefill_surprisal_of_a_left_padded_row_is_its_own():
    from kvcompress.hf.reconstruct import prefill_surprisal

    model = tiny_llama()
    gen = torch.Generator().manual_seed(4)
    short = torch.randint(0, 50, (1, 9), generator=gen)
    long = torch.randint(0, 50, (1, 13), generator=gen)
    ids = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :4] = 0
    got = prefill_surprisal(model, ids, attention_mask=mask)
    torch.testing.assert_close(got[0, 4:], reference_prefill_surprisal(model, short)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], reference_prefill_surprisal(model, long)[0], atol=1e-4, rtol=1e-4)
    assert float(got[0, :4].abs().max()) == 0.0


def test_token_surprisal_in_row_blocks_equals_one_block():
    from kvcompress.hf.reconstruct import token_surprisal

    gen = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(2, 11, 8, generator=gen)
    tgt = torch.randint(0, 30, (2, 11), generator=gen)
    with torch.no_grad():
        ref = -head(hidden).log_softmax(-1).gather(-1, tgt[..., None])[..., 0]
        for rows in (1, 3, 64):
            torch.testing.assert_close(token_surprisal(head, hidden, tgt, rows=rows), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk, lead", [(5, 0), (64, 0), (5, 2)])
def test_pass_surprisal_equals_full_forward_logits(chunk, lead):
    """The pass's own surprisal (a measured alternative): the position before a chunk's token j in a
    fresh full forward (context + repeat + the lead-in + chunk) predicts it."""
    model = tiny_llama()
    gen = torch.Generator().manual_seed(6)
    ctx = torch.randint(0, 50, (2, 17), generator=gen)
    repeat = torch.randint(0, 50, (1, 3), generator=gen)
    got = reconstruction_scores(model, prefill_kv(model, ctx), ctx, repeat_ids=repeat, chunk=chunk, surprisal=True,
                                lead=lead)
    B, T = ctx.shape
    ref = torch.zeros(B, T)
    for s in range(0, T, chunk):
        before, piece = ctx[:, max(0, s - lead):s], ctx[:, s:s + chunk]
        ids = torch.cat([ctx, repeat.expand(B, -1), before, piece], dim=1)
        with torch.no_grad():
            logp = model(input_ids=ids).logits.float().log_softmax(-1)
        head = T + 3 + before.shape[1]
        rows = logp[:, head - 1: head - 1 + piece.shape[1]]
        ref[:, s:s + piece.shape[1]] = -rows.gather(-1, piece[..., None])[..., 0]
    torch.testing.assert_close(got.surprisal, ref, atol=1e-4, rtol=1e-4)
    assert reconstruction_scores(model, prefill_kv(model, ctx), ctx, repeat_ids=repeat).surprisal is None


def test_surprisal_bad_inputs():
    from kvcompress.hf.reconstruct import prefill_surprisal

    model = tiny_llama()
    ctx = torch.randint(0, 50, (1, 6))
    with pytest.raises(ValueError, match="model"):
        prefill_surprisal(None, ctx)
    with pytest.raises(ValueError, match="context is empty"):
        prefill_surprisal(model, ctx[:, :0])
    with pytest.raises(ValueError, match="integer tensor"):  # float ids: not "empty"
        prefill_surprisal(model, ctx.float())
    with pytest.raises(ValueError, match="attention_mask"):
        prefill_surprisal(model, ctx, attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="layers"):  # the model's output is needed
        reconstruction_scores(model, prefill_kv(model, ctx), ctx, repeat_ids=torch.tensor([[1]]), layers=[0],
                              surprisal=True)
    with pytest.raises(ValueError, match="surprisal"):
        reconstruction_scores(model, prefill_kv(model, ctx), ctx, repeat_ids=torch.tensor([[1]]), surprisal=1)
    assert model.config._attn_implementation == "eager"
