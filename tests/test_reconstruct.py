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


def reference(model, ctx, repeat, chunk, starts=None):
    """Per layer [B, H, T]: for each chunk, a fresh full forward over context + repeat + chunk with
    eager attention; max over the pass's queries and the group's heads of the full softmax."""
    B, T = ctx.shape
    H = model.config.num_key_value_heads
    G = model.config.num_attention_heads // H
    out = [torch.zeros(B, H, T) for _ in model.model.layers]
    starts = list(range(0, T, chunk)) if starts is None else starts
    for s in starts:
        ids = torch.cat([ctx, repeat.expand(B, -1), ctx[:, s:s + chunk]], dim=1)
        with torch.no_grad():
            att = model(input_ids=ids, output_attentions=True).attentions
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
    assert model.config._attn_implementation == "eager"
