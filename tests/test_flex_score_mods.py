"""score_mod factories of kvcompress.flex.

score_mods are pointwise torch functions, so ``dense_apply`` evaluates one on broadcast index
tensors over the whole [B, H_q, L, N] score matrix (fast, for hypothesis); a few tests also run
them through eager (uncompiled) flex_attention, torch's math reference, which traces each new
closure (a few seconds) but compiles nothing.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import create_mask, flex_attention

from kvcompress import flex
from kvcompress.attention import proportional_attention

NEG_INF = float("-inf")


def loop_reference(q, k, v, log_sizes, *, causal=True, use_sizes=True, scale=None):
    """Proportional attention one (batch, query head, query) at a time, in float64.

    q: [B, H_q, L, D], k/v: [B, H_kv, N, D], log_sizes: [B, H_kv, N]
    """
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Hq, L, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // G
            for i in range(L):
                logits, rows = [], []
                for j in range(N):
                    ls = float(log_sizes[b, kv, j])
                    if ls == NEG_INF or (causal and j > N - L + i):
                        continue
                    dot = float((q[b, h, i].double() * k[b, kv, j].double()).sum())
                    logits.append(dot * scale + (ls if use_sizes else 0.0))
                    rows.append(v[b, kv, j].double())
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                total = sum(w)
                out[b, h, i] = sum(wi / total * r for wi, r in zip(w, rows))
    return out


def random_inputs(B, Hq, Hkv, L, N, D, pad=0, seed=0, dtype=torch.float32):
    """Random q/k/v and integer sizes 1..4 (log-sized), the first ``pad`` slots of each row padding."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    sizes = torch.randint(1, 5, (B, Hkv, N), generator=g).float()
    log_sizes = sizes.log()
    log_sizes[:, :, :pad] = NEG_INF
    return q, k, v, log_sizes


def dense_apply(q, k, v, score_mod, scale=None):
    """softmax(score_mod(q k^T * scale)) v with index tensors broadcast over [B, H_q, L, N]."""
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    kk = k.repeat_interleave(Hq // Hkv, dim=1).double()  # only the harness repeats keys
    vv = v.repeat_interleave(Hq // Hkv, dim=1).double()
    scores = q.double() @ kk.transpose(-1, -2) * scale
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(Hq).view(1, Hq, 1, 1)
    qi = torch.arange(L).view(1, 1, L, 1)
    kv = torch.arange(N).view(1, 1, 1, N)
    return torch.softmax(score_mod(scores, b, h, qi, kv), dim=-1) @ vv


def eager_flex(q, k, v, score_mod, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        return flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True, **kw)


def test_names_are_stable_and_descriptive():
    ls = torch.zeros(1, 1, 4)
    assert flex.log_size_bias(ls).__name__ == "log_size_bias"
    assert flex.padding_mask(ls).__name__ == "padding_mask"
    assert flex.bottom_right_causal(3).__name__ == "bottom_right_causal"
    assert flex.bottom_right_causal_mask(3).__name__ == "bottom_right_causal_mask"
    mod = flex.proportional_score_mod(ls, 1, offset=2)
    assert mod.__name__ == "compose(log_size_bias,bottom_right_causal)"
    # A new closure over other tensors keeps the name (no id or value in it).
    assert flex.log_size_bias(torch.ones(2, 2, 8), 3).__name__ == "log_size_bias"


def test_score_mods_pointwise():
    ls = torch.tensor([[[0.0, math.log(3.0)], [NEG_INF, 1.0]]])  # [B=1, H_kv=2, N=2]
    s, z = torch.tensor(0.5), torch.tensor(0)
    bias = flex.log_size_bias(ls, groups=2)
    # query head 3 belongs to KV head 1 with 2 groups
    assert bias(s, z, torch.tensor(3), z, torch.tensor(1)) == pytest.approx(1.5)
    assert bias(s, z, torch.tensor(1), z, torch.tensor(1)) == pytest.approx(0.5 + math.log(3.0))
    pad = flex.padding_mask(ls, groups=2)
    assert pad(s, z, torch.tensor(2), z, torch.tensor(0)) == NEG_INF
    assert pad(s, z, torch.tensor(2), z, torch.tensor(1)) == pytest.approx(0.5)
    causal = flex.bottom_right_causal(torch.tensor(4))
    assert causal(s, z, z, torch.tensor(2), torch.tensor(6)) == pytest.approx(0.5)
    assert causal(s, z, z, torch.tensor(2), torch.tensor(7)) == NEG_INF


def test_compose_applies_left_to_right():
    def add_one(score, b, h, q, kv):
        return score + 1

    def double(score, b, h, q, kv):
        return score * 2

    z = torch.tensor(0)
    composed = flex.compose(add_one, double)
    assert composed(torch.tensor(1.0), z, z, z, z) == 4.0
    assert composed.__name__ == "compose(add_one,double)"
    with pytest.raises(ValueError, match="score_mods"):
        flex.compose()


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.integers(1, 3), L=st.integers(1, 4),
    extra=st.integers(0, 6), pad=st.integers(0, 2), causal=st.booleans(), use_sizes=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_proportional_score_mod_matches_loop_reference(B, Hkv, G, L, extra, pad, causal, use_sizes, seed):
    N = pad + L + extra  # the L new tokens are the last slots and never padding
    q, k, v, ls = random_inputs(B, Hkv * G, Hkv, L, N, 8, pad=pad, seed=seed)
    mod = flex.proportional_score_mod(ls, G, offset=N - L if causal else None, use_sizes=use_sizes)
    ref = loop_reference(q, k, v, ls, causal=causal, use_sizes=use_sizes)
    torch.testing.assert_close(dense_apply(q, k, v, mod), ref, atol=1e-9, rtol=1e-9)


def test_eager_flex_with_score_mod_agrees_with_sdpa_reference_and_ignores_padding():
    q, k, v, ls = random_inputs(2, 6, 2, 3, 12, 16, pad=4, seed=1)
    mod = flex.proportional_score_mod(ls, 3, offset=12 - 3)
    out = eager_flex(q, k, v, mod)
    torch.testing.assert_close(out, proportional_attention(q, k, v, ls), atol=1e-5, rtol=1e-5)
    # Padding slots: changing their keys/values must not change anything.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :4] = 100.0
    v2[:, :, :4] = -1e4
    torch.testing.assert_close(eager_flex(q, k2, v2, mod), out, atol=1e-6, rtol=1e-6)


def test_block_mask_is_bottom_right_causal():
    L, N = 3, 7
    dense = create_mask(flex.bottom_right_causal_mask(N - L), None, None, L, N, device="cpu")
    expected = torch.tensor([[j <= N - L + i for j in range(N)] for i in range(L)])
    assert torch.equal(dense[0, 0], expected)
    bm = flex.causal_block_mask(L, N)
    assert bm.shape[-2:] == (L, N)
    q, k, v, ls = random_inputs(1, 2, 1, L, N, 8, seed=2)
    out = eager_flex(q, k, v, flex.log_size_bias(ls, 2), block_mask=bm)
    torch.testing.assert_close(out.double(), loop_reference(q, k, v, ls), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="q_len"):
        flex.causal_block_mask(8, 7)


def test_offset_must_be_an_integer():
    with pytest.raises(ValueError, match="offset"):
        flex.bottom_right_causal(1.5)
    with pytest.raises(ValueError, match="offset"):
        flex.bottom_right_causal(torch.tensor([1, 2]))
