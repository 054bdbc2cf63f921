"""flex_proportional_attention through torch.compile on CPU (inductor + the system C++ compiler).

Compiling is the slow part (5-40 s a graph on CPU), so the tests share one layout
(B=2, H_q=6, H_kv=2, D=32, float32), which costs two graphs: L == 1 and L > 1. Causality and
use_sizes are data, not Python flags, so they reuse those graphs. The half-dtype test needs
one graph per dtype and is marked ``slow``.
"""

from __future__ import annotations

import pytest
import torch

from kvcompress import flex
from kvcompress.attention import expand_state, proportional_attention
from kvcompress.types import KVState

from test_flex_score_mods import NEG_INF, loop_reference, random_inputs

B, HQ, HKV, D = 2, 6, 2, 32


def close(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("use_sizes", [True, False])
def test_decode_matches_loop_and_sdpa_references(causal, use_sizes):
    q, k, v, ls = random_inputs(B, HQ, HKV, 1, 37, D, seed=3)
    ls[0, :, :5] = NEG_INF  # row 0 left-padded, row 1 not
    ls[1, 1, 10:13] = NEG_INF  # holes in one head, e.g. dropped slots
    out = flex.flex_proportional_attention(q, k, v, ls, causal=causal, use_sizes=use_sizes)
    assert out.shape == (B, HQ, 1, D) and out.dtype == torch.float32
    close(out, loop_reference(q, k, v, ls, causal=causal, use_sizes=use_sizes), 1e-5)
    close(out, proportional_attention(q, k, v, ls, causal=causal, use_sizes=use_sizes), 1e-4)


def test_row_of_padding_only_gives_zeros_on_both_backends():
    q, k, v, ls = random_inputs(B, HQ, HKV, 1, 37, D, seed=10)
    ls[1] = NEG_INF
    for fn in (flex.flex_proportional_attention, flex.sdpa_proportional_attention):
        out = fn(q, k, v, ls)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        close(out[0], loop_reference(q[:1], k[:1], v[:1], ls[:1])[0], 1e-5)


def test_multi_token_query_after_compressed_cache():
    L, N = 5, 29  # 24 compressed slots, then 5 new tokens (size 1) at the end
    q, k, v, ls = random_inputs(B, HQ, HKV, L, N, D, pad=2, seed=4)
    ls[:, :, -L:] = 0.0
    for causal in (True, False):
        out = flex.flex_proportional_attention(q, k, v, ls, causal=causal, scale=0.3)
        close(out, loop_reference(q, k, v, ls, causal=causal, scale=0.3), 1e-5)
        close(out, proportional_attention(q, k, v, ls, causal=causal, scale=0.3), 1e-4)
    # The causal result must differ from the non-causal one (the mask does something).
    assert not torch.allclose(flex.flex_proportional_attention(q, k, v, ls),
                              flex.flex_proportional_attention(q, k, v, ls, causal=False))


def merged_state(L, seed):
    """A merged cache whose rows all expand to the same token count, last L slots size 1.

    Equal totals keep the L new tokens at the end of every expanded row, where bottom-right
    causality puts them.
    """
    g = torch.Generator().manual_seed(seed)
    N = 23
    sizes = torch.randint(1, 5, (B, HKV, N), generator=g)
    sizes[:, :, -L:] = 1
    sizes[:, :, 0] += sizes.sum(-1).amax() - sizes.sum(-1)  # equalise row totals
    keys = torch.randn(B, HKV, N, D, generator=g)
    values = torch.randn(B, HKV, N, D, generator=g)
    positions = torch.arange(N).expand(B, HKV, N).clone()
    return KVState(keys=keys, values=values, log_sizes=sizes.float().log(), positions=positions,
                   num_tokens=int(sizes[0, 0].sum()))


@pytest.mark.parametrize("L", [1, 4])
def test_merged_cache_equals_expanded_cache(L):
    state = merged_state(L, seed=5 + L)
    ek, ev, els = expand_state(state)
    assert ek.shape[2] > state.num_slots  # something really is merged
    q = torch.randn(B, HQ, L, D, generator=torch.Generator().manual_seed(9))
    merged = flex.flex_proportional_attention(q, state.keys, state.values, state.log_sizes)
    expanded_flex = flex.flex_proportional_attention(q, ek, ev, els)
    expanded_ref = proportional_attention(q, ek, ev, els)
    close(merged, expanded_flex, 1e-5)
    close(merged, expanded_ref, 1e-5)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine OpenMP barriers made each small flex call
    20-50x slower with two threads; on an idle machine it changes little."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_decode_sweep_does_not_recompile_per_step(one_thread):
    """Simulates 1,000 decode steps (N = 1001 .. 2000, L = 1): a handful of graphs at most.

    The cache grows by concatenation, as transformers' DynamicLayer does.
    """
    g = torch.Generator().manual_seed(6)
    k = torch.randn(B, HKV, 1000, D, generator=g)
    v = torch.randn(B, HKV, 1000, D, generator=g)
    ls = torch.rand(B, HKV, 1000, generator=g)
    q = torch.randn(B, HQ, 1, D, generator=g)
    before = flex.compile_count()
    for _ in range(1000):
        k = torch.cat([k, torch.randn(B, HKV, 1, D, generator=g)], dim=2)
        v = torch.cat([v, torch.randn(B, HKV, 1, D, generator=g)], dim=2)
        ls = torch.cat([ls, torch.rand(B, HKV, 1, generator=g)], dim=2)
        out = flex.flex_proportional_attention(q, k, v, ls)
    compiles = flex.compile_count() - before
    assert compiles <= 2, f"{compiles} compilations over 1,000 decode steps"
    close(out, proportional_attention(q, k, v, ls), 1e-4)
    # Multi-token inputs of changing lengths share one dynamic graph too.
    before = flex.compile_count()
    for L, n in [(3, 40), (7, 100), (30, 300), (64, 1000)]:
        flex.flex_proportional_attention(q.expand(B, HQ, L, D).contiguous(), k[:, :, :n].contiguous(),
                                         v[:, :, :n].contiguous(), ls[:, :, :n].contiguous())
    assert flex.compile_count() - before <= 2


def test_bad_inputs_raise_before_compiling():
    q, k, v, ls = random_inputs(B, HQ, HKV, 1, 10, D)
    before = flex.compile_count()
    with pytest.raises(ValueError, match="query heads"):
        flex.flex_proportional_attention(q[:, :5], k, v, ls)
    with pytest.raises(ValueError, match="log_sizes"):
        flex.flex_proportional_attention(q, k, v, ls[:, :, :9])
    with pytest.raises(ValueError, match="keys/values dtype"):
        flex.flex_proportional_attention(q, k.double(), v, ls)
    with pytest.raises(ValueError, match="query length"):
        flex.flex_proportional_attention(q.expand(B, HQ, 11, D), k, v, ls)
    with pytest.raises(ValueError, match="head dims"):
        flex.flex_proportional_attention(q[..., :16], k[..., :16], v[..., :16], ls)
    with pytest.raises(ValueError, match="values"):
        flex.sdpa_proportional_attention(q, k, v[:, :, :9], ls)
    assert flex.compile_count() == before


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_keep_the_bias_in_float32(dtype):
    q, k, v, ls = random_inputs(B, HQ, HKV, 1, 40, D, pad=3, seed=7, dtype=dtype)
    out = flex.flex_proportional_attention(q, k, v, ls)
    assert out.dtype == dtype
    close(out, loop_reference(q.float(), k.float(), v.float(), ls), 2e-2)
    # Equal logits (zero keys), log-sizes 4 + 0.001 j: a half-precision bias would round them all
    # to one value and give uniform weights, so the mean of the centred values would be 0.
    # (Same shapes as above: no further compilation.)
    N = 16
    zeros = torch.zeros(B, HKV, N, D, dtype=dtype)
    centred = torch.arange(N, dtype=torch.float32) - 7.5  # [N]
    vals = centred[None, None, :, None].expand(B, HKV, N, D).to(dtype).contiguous()
    ls16 = (4 + 0.001 * torch.arange(N, dtype=torch.float32)).expand(B, HKV, N).contiguous()
    out16 = flex.flex_proportional_attention(torch.zeros(B, HQ, 1, D, dtype=dtype), zeros, vals, ls16)
    expected = float((torch.softmax(ls16[0, 0].double(), 0) * centred.double()).sum())  # ~0.021
    assert out16.float().numpy() == pytest.approx(expected, rel=2e-2)


def test_auto_probe_on_cpu_picks_a_backend_and_caches_it():
    flex.clear_backend_decisions()
    q, k, v, ls = random_inputs(B, HQ, HKV, 1, 200, D, seed=8)
    out = flex.auto_proportional_attention(q, k, v, ls)
    close(out, proportional_attention(q, k, v, ls), 1e-4)
    (key, decision), = flex.backend_decisions().items()
    assert key[-1] == 256 and key[-2] == 1  # N bucket, L bucket
    assert decision.reason == "probe" and decision.backend in flex.BACKENDS
    assert decision.flex_ms > 0 and decision.sdpa_ms > 0
    flex.clear_backend_decisions()


def test_each_signature_gets_its_own_kernel():
    """Separate code objects keep dynamo's per-function recompile limit out of reach."""
    q, k, v, _ = random_inputs(1, 4, 2, 1, 8, 32)
    a = flex.kernels._kernel_for(q, k, v)
    assert flex.kernels._kernel_for(q, k[:, :, :5], v[:, :, :5]) is a  # N is not part of it
    b = flex.kernels._kernel_for(q.double(), k.double(), v.double())
    c = flex.kernels._kernel_for(q.expand(3, 4, 1, 32), k.expand(3, 2, 8, 32), v.expand(3, 2, 8, 32))
    assert len({id(a), id(b), id(c)}) == 3
    assert len({id(f.__wrapped__.__code__) for f in (a, b, c)}) == 3  # dynamo caches per code
