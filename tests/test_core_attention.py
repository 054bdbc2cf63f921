"""Proportional attention over a merged state equals attention over its expanded cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state
from kvcompress import Pipeline, PipelineConfig, expand_state, proportional_attention
from kvcompress.attention import proportional_bias
from kvcompress.types import KVState


def _compress(state: KVState, keep: float, rounds: int, chunker: str = "delimiter") -> KVState:
    cfg = PipelineConfig(keep_ratio=keep, sinks=1, recent=2, chunker={"name": chunker}, on_infeasible="best_effort")
    pipe = Pipeline(cfg)
    for _ in range(rounds):
        state, _ = pipe.compress(state)
    return state


def _append(keys, values, log_sizes, new_k, new_v):
    """The q_len new tokens go after the cache, as in decoding: [.., N + q, D], log-size 0."""
    zeros = torch.zeros(new_k.shape[:3])
    return torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2), torch.cat([log_sizes, zeros], 2)


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), Hkv=st.integers(1, 2), groups=st.integers(1, 3),
       N=st.integers(6, 30), q_len=st.integers(1, 4), keep=st.floats(0.1, 0.9), rounds=st.integers(1, 2))
def test_merged_attention_equals_expanded_attention(seed, B, Hkv, groups, N, q_len, keep, rounds):
    D = 8
    state = make_state(seed, B=B, H=Hkv, N=N, D=D, with_membership=False)
    merged = _compress(state, keep, rounds)
    gen = torch.Generator().manual_seed(seed)
    new_k, new_v = torch.randn(B, Hkv, q_len, D, generator=gen), torch.randn(B, Hkv, q_len, D, generator=gen)
    query = torch.randn(B, Hkv * groups, q_len, D, generator=gen)

    k_m, v_m, ls_m = _append(merged.keys, merged.values, merged.log_sizes, new_k, new_v)
    k_e, v_e, ls_e = _append(*expand_state(merged), new_k, new_v)
    assert k_e.shape[2] == N + q_len  # every row covers all N tokens
    out_m = proportional_attention(query, k_m, v_m, ls_m, causal=True)
    out_e = proportional_attention(query, k_e, v_e, ls_e, causal=True)
    assert torch.allclose(out_m, out_e, atol=1e-5)


def test_without_the_log_size_term_merged_attention_differs():
    state = make_state(4, B=1, H=2, N=24, D=8, with_membership=False)
    merged = _compress(state, 0.3, 2)
    assert bool((merged.sizes() > 2.5).any())
    query = torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(0))
    k_e, v_e, ls_e = expand_state(merged)
    ref = proportional_attention(query, k_e, v_e, ls_e, causal=False)
    sized = proportional_attention(query, merged.keys, merged.values, merged.log_sizes, causal=False)
    plain = proportional_attention(query, merged.keys, merged.values, merged.log_sizes, causal=False,
                                   use_sizes=False)
    assert torch.allclose(sized, ref, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3


def test_merging_duplicate_tokens_leaves_attention_unchanged():
    # tokens come in runs of identical keys/values; merging a run changes nothing for attention
    gen = torch.Generator().manual_seed(0)
    B, H, D, runs, length = 1, 2, 6, 5, 4
    k = torch.randn(B, H, runs, D, generator=gen).repeat_interleave(length, 2)
    v = torch.randn(B, H, runs, D, generator=gen).repeat_interleave(length, 2)
    state = KVState.from_raw(k, v)
    merged, report = Pipeline(PipelineConfig(max_slots=runs, sinks=0, chunker={"name": "global"})).compress(state)
    assert report.budget_met and merged.num_slots == runs
    query = torch.randn(B, 2 * H, 3, D, generator=gen)
    full = proportional_attention(query, k, v, state.log_sizes, causal=False)
    small = proportional_attention(query, merged.keys, merged.values, merged.log_sizes, causal=False)
    assert torch.allclose(full, small, atol=1e-5)


def test_gqa_query_heads_share_their_kv_head():
    gen = torch.Generator().manual_seed(1)
    B, Hkv, G, L, N, D = 1, 2, 3, 2, 5, 4
    q = torch.randn(B, Hkv * G, L, D, generator=gen)
    k, v = torch.randn(B, Hkv, N, D, generator=gen), torch.randn(B, Hkv, N, D, generator=gen)
    ls = torch.log(torch.randint(1, 4, (B, Hkv, N), generator=gen).float())
    out = proportional_attention(q, k, v, ls, causal=True)
    for hq in range(Hkv * G):
        h = hq // G
        for i in range(L):
            n_visible = N - L + i + 1
            logits = q[0, hq, i] @ k[0, h, :n_visible].T / D ** 0.5 + ls[0, h, :n_visible]
            ref = torch.softmax(logits, -1) @ v[0, h, :n_visible]
            assert torch.allclose(out[0, hq, i], ref, atol=1e-5)


def test_padding_slots_are_never_attended():
    ls = torch.tensor([[[0.0, float("-inf"), 0.0]]])
    bias = proportional_bias(ls, q_len=1, groups=1)
    assert bias[0, 0, 0, 1] == float("-inf")
    k = torch.randn(1, 1, 3, 2)
    v = torch.randn(1, 1, 3, 2)
    v_poisoned = v.clone()
    v_poisoned[0, 0, 1] = 1e6
    q = torch.randn(1, 1, 1, 2)
    assert torch.allclose(proportional_attention(q, k, v, ls), proportional_attention(q, k, v_poisoned, ls))


@pytest.mark.parametrize("causal", [True, False])
def test_sizes_equal_repeated_tokens(causal):
    # a slot of size 3 weighs exactly like 3 copies of the token
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 1, 3, 4, generator=gen), torch.randn(1, 1, 3, 4, generator=gen)
    q = torch.randn(1, 1, 1, 4, generator=gen)
    ls = torch.tensor([[[1.0, 3.0, 1.0]]]).log()
    rep = torch.tensor([1, 3, 1])
    out = proportional_attention(q, k, v, ls, causal=causal)
    ref = proportional_attention(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2),
                                 torch.zeros(1, 1, 5), causal=causal)
    assert torch.allclose(out, ref, atol=1e-6)


# ---------------------------------------------------------------------------- half-precision path
def _slow_reference(q, k, v, ls, causal, extra_mask=None):
    """Per query head, float64: softmax over every slot the head may see, written out plainly."""
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    out = torch.zeros(B, Hq, L, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            for i in range(L):
                s = q[b, h, i].double() @ k[b, kv].double().T / D ** 0.5 + ls[b, kv].double()
                if causal:
                    s[N - L + i + 1:] = float("-inf")
                if extra_mask is not None:
                    s[~extra_mask[b, i]] = float("-inf")
                out[b, h, i] = s.softmax(-1) @ v[b, kv].double()
    return out


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), Hkv=st.integers(1, 2), groups=st.integers(1, 3), N=st.integers(2, 24),
       L=st.integers(1, 4), causal=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_half_compute_dtype_matches_the_slow_reference(seed, Hkv, groups, N, L, causal, dtype):
    L = min(L, N)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Hkv * groups, L, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, Hkv, N, 16, generator=gen).to(dtype) for _ in range(2))
    ls = torch.log(torch.randint(1, 6, (2, Hkv, N), generator=gen).float())
    if N - L >= 1:
        ls[:, :, 0] = float("-inf")  # a padding slot
    mask = torch.rand(2, L, N, generator=gen) > 0.3
    mask[..., N - L] = True  # a slot every query row sees, causal or not
    ref = _slow_reference(q, k, v, ls, causal, mask)
    out = proportional_attention(q, k, v, ls, causal=causal, extra_mask=mask, compute_dtype=dtype)
    assert out.dtype == dtype
    # the bias and the product are rounded to the dtype: a few units of its precision
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert ((out.double() - ref).abs() <= 8 * eps * (1 + ref.abs())).all()
    full = proportional_attention(q, k, v, ls, causal=causal, extra_mask=mask, compute_dtype=torch.float32)
    assert ((full.double() - ref).abs() <= eps * (1e-3 + ref.abs())).all()  # float32 math, output rounded


def test_compute_dtype_default_and_bad_value():
    from types import SimpleNamespace

    from kvcompress.attention import native_dtype

    cpu_half = torch.zeros(1, dtype=torch.bfloat16)
    assert native_dtype(cpu_half) == torch.float32  # CPU stays exact
    assert native_dtype(SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)) == torch.bfloat16
    assert native_dtype(SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)) == torch.float32
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="compute_dtype"):
        proportional_attention(q, k, v, torch.zeros(1, 1, 4), compute_dtype=torch.int8)
