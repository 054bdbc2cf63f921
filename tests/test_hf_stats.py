"""Attention statistics the cache keeps for scorers (query window, attention received) and
half-precision models."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import (  # noqa: E402
    one_thread,  # noqa: F401  (autouse fixture)
    MERGE_NOTHING, MERGING, expanded_reference, make_cache, prompt_ids, stock_copy, tiny_model,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402


def _forward(model, ids, cache, **kw):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, **kw)


def _capture_queries(model, layer_idx):
    """Post-RoPE queries of one attention module, computed independently from its inputs."""
    seen = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        B, L, _ = hidden.shape
        q = module.q_proj(hidden).view(B, L, -1, module.head_dim).transpose(1, 2)
        seen.append(apply_rotary_pos_emb(q, q, cos, sin)[0])

    handle = model.model.layers[layer_idx].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return seen, handle


def test_query_window_keeps_the_last_w_post_rope_queries():
    model = tiny_model(seed=50)
    W = 6
    cache = make_cache(model, **MERGING, query_window=W)
    seen, handle = _capture_queries(model, 1)
    _forward(model, prompt_ids(51, 40), cache)
    state = cache.layers[1].state()
    assert tuple(state.extras["queries"].shape) == (1, 4, W, 16)  # [B, H_q, W, D]
    torch.testing.assert_close(state.extras["queries"], torch.cat(seen, 2)[:, :, -W:], atol=1e-5, rtol=0)
    for t in range(3):  # rolling while decoding
        _forward(model, prompt_ids(52 + t, 1), cache)
    torch.testing.assert_close(cache.layers[1].queries, torch.cat(seen, 2)[:, :, -W:], atol=1e-5, rtol=0)
    handle.remove()


@pytest.mark.parametrize("pad", [0, 5])
def test_reference_queries_are_strided_over_the_prefill_last_included(pad):
    """A strategy declaring Needs(reference_queries=R) gets R post-RoPE prefill queries per layer,
    at positions start + round(k (L_real - 1) / (R - 1)), kept through the prefill compression."""
    from dataclasses import dataclass

    from kvcompress.protocols import Needs
    from kvcompress.registry import GUARDS

    @dataclass(frozen=True)
    class _WantsReferences:
        needs = Needs(reference_queries=5)

        def __call__(self, state):
            return torch.zeros_like(state.valid)

    GUARDS.register("test-wants-references")(_WantsReferences)
    try:
        model = tiny_model(seed=64)
        cache = make_cache(model, **MERGING, guards=[{"name": "test-wants-references"}])
        seen, handle = _capture_queries(model, 1)
        L = 41
        ids = prompt_ids(65, L)
        mask = torch.ones(1, L, dtype=torch.long)
        mask[:, :pad] = 0
        _forward(model, ids, cache, attention_mask=mask)
        handle.remove()
        assert cache.layers[1].n < L  # compressed in the prefill, the queries kept
        got = cache.layers[1].state().extras["reference_queries"]
        real = L - pad
        want_pos = [pad + round(k * (real - 1) / 4) for k in range(5)]
        assert want_pos[-1] == L - 1
        torch.testing.assert_close(got, seen[0][:, :, want_pos], atol=1e-5, rtol=0)
        _forward(model, prompt_ids(66, 1), cache, attention_mask=torch.ones(1, L + 1, dtype=torch.long))
        torch.testing.assert_close(cache.layers[1].state().extras["reference_queries"], got)  # decode keeps them
    finally:
        GUARDS.unregister("test-wants-references")


def test_attention_received_matches_eager_attention_weights():
    """attn_acc[b, h, j] = sum over forwards, queries and the query heads of KV head h of the
    attention probability of slot j (merge nothing: slot j is token j)."""
    model = tiny_model(seed=53)
    eager = stock_copy(model)
    eager.set_attn_implementation("eager")
    cache = make_cache(model, **MERGE_NOTHING, track_attention=True)
    from transformers import DynamicCache

    ref = DynamicCache(config=eager.config)
    inputs = [prompt_ids(54, 24), prompt_ids(55, 1), prompt_ids(56, 1), prompt_ids(57, 3)]
    want = [torch.zeros(1, 2, 29) for _ in range(2)]
    for ids in inputs:
        _forward(model, ids, cache)
        out = _forward(eager, ids, ref, output_attentions=True)
        for layer, weights in enumerate(out.attentions):  # [B, H_q, q, N]
            B, Hq, q, N = weights.shape
            want[layer][:, :, :N] += weights.reshape(B, 2, Hq // 2, q, N).sum(dim=(2, 3))
    for layer in range(2):
        got = cache.layers[layer].state().stats["attn_acc"]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want[layer], atol=1e-4, rtol=0)


def test_attention_received_is_summed_over_merged_members():
    model = tiny_model(seed=58)
    cache = make_cache(model, **MERGING, track_attention=True)
    _forward(model, prompt_ids(59, 40), cache)
    acc = cache.layers[0].state().stats["attn_acc"]
    # every query's probabilities sum to 1 per query head: total = 40 queries x 2 heads per group
    torch.testing.assert_close(acc.sum(-1), torch.full((1, 2), 80.0), atol=1e-3, rtol=0)
    assert cache.layers[0].n < 40


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_keep_sizes_in_float32(dtype):
    model = tiny_model(seed=60, dtype=dtype)
    stock = stock_copy(model)
    cache = make_cache(model, **MERGING)
    _forward(model, prompt_ids(61, 48), cache)
    layer = cache.layers[0]
    assert layer.keys.dtype == dtype and layer.log_sizes.dtype == torch.float32
    ref = expanded_reference(cache, model.config)
    nxt = prompt_ids(62, 3)
    got = _forward(model, nxt, cache).logits.float()
    want = _forward(stock, nxt, ref).logits.float()
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max())
    with torch.no_grad():
        out = model.generate(input_ids=prompt_ids(63, 30), cache=make_cache(model, **MERGING), max_new_tokens=5,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (1, 35)


def _received_by_loops(query, keys, log_sizes, scale, causal, query_valid):
    """attention_received by plain loops: one softmax per (row, query head, query)."""
    B, Hq, L, _ = query.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            for i in range(L):
                if query_valid is not None and not bool(query_valid[b, i]):
                    continue
                seen = N - L + i + 1 if causal else N
                if seen <= 0:
                    continue
                logits = [float(query[b, h, i].double() @ keys[b, kv, j].double()) * scale
                          + float(log_sizes[b, kv, j]) for j in range(seen)]
                top = max(logits)
                if top == float("-inf"):
                    continue
                weights = [torch.exp(torch.tensor(x - top, dtype=torch.float64)) for x in logits]
                total = sum(weights)
                for j in range(seen):
                    out[b, kv, j] += weights[j] / total
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L,N,max_elements", [(12, 12, 40), (12, 12, 1 << 20), (3, 17, 30), (9, 20, 1)])
def test_attention_received_matches_loops_in_every_query_chunk(causal, L, N, max_elements):
    from kvcompress.hf.attention import attention_received

    gen = torch.Generator().manual_seed(L * 100 + N)
    B, Hq, Hkv, D = 2, 4, 2, 8
    query = torch.randn(B, Hq, L, D, generator=gen)
    keys = torch.randn(B, Hkv, N, D, generator=gen)
    log_sizes = torch.rand(B, Hkv, N, generator=gen).log1p()
    log_sizes[0, 1, 2] = float("-inf")  # a padding slot receives nothing
    query_valid = torch.rand(B, L, generator=gen) > 0.25
    got = attention_received(query, keys, log_sizes, scale=0.3, causal=causal, use_sizes=True,
                             query_valid=query_valid, max_elements=max_elements)
    want = _received_by_loops(query, keys, log_sizes, 0.3, causal, query_valid)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert float(got[0, 1, 2]) == 0.0
