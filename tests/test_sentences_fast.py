"""The sentence guard's query signal (tail-masked future) against its previous version
(tests/slow_reference/sentences_v0.py): bit-identical on uncompressed and merged states,
left-padded rows, and windows longer than the prompt."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state
from kvcompress import Pipeline, PipelineConfig
from kvcompress.strategies.sentences import query_signal, sentence_ids
from slow_reference.sentences_v0 import query_signal as query_signal_v0


def _with_queries(state, W, Hq, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(state.batch_size, Hq, W, state.keys.shape[-1], generator=gen) * 3
    return state.replace(extras={**state.extras, "queries": q})


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), N=st.integers(2, 60), W=st.integers(1, 70), G=st.integers(1, 3),
       layers=st.integers(1, 4), pad=st.booleans(), merged=st.booleans(), skip=st.integers(0, 2))
def test_query_signal_bit_identical_to_the_previous_version(seed, N, W, G, layers, pad, merged, skip):
    states = []
    for layer in range(layers):
        s = make_state(seed + layer, B=2, H=2, N=N, pad=[min(3, N - 1), 0] if pad else None,
                       with_membership=False)
        if merged:  # slots out of token order, padding slots, sizes > 1
            cfg = PipelineConfig(keep_ratio=0.5, sinks=1, recent=2, chunker="fixed", clusterer="gsc", merger="mean",
                                 on_infeasible="best_effort")
            s = Pipeline(cfg).compress(s)[0]
        states.append(_with_queries(s, W, 2 * G, seed))
    sid = sentence_ids(states[0].token_ids, states[0].vocab)
    num = int(sid.max()) + 1
    assert torch.equal(query_signal(states, sid, num, skip), query_signal_v0(states, sid, num, skip))


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), N=st.integers(2, 60), W=st.integers(1, 70), G=st.integers(1, 3),
       extra=st.integers(0, 500))
def test_max_attention_in_a_reused_scratch_is_the_same(seed, N, W, G, extra):
    """The logits written into a caller's (larger, dirty) scratch and the softmax taken in place:
    bit for bit the allocating path."""
    from kvcompress.strategies.sentences import max_attention

    s = _with_queries(make_state(seed, B=2, H=2, N=N, with_membership=False), W, 2 * G, seed)
    q = s.extras["queries"]
    scratch = torch.full((q.numel() // q.shape[-1] * N + extra,), float("nan"))
    assert torch.equal(max_attention(s, q, scratch), max_attention(s, q))


def test_vocabulary_lookups_answer_on_the_ids_device():
    # the tables live on the CPU; on a GPU the ids (and everything after them) do not. The meta
    # device stands in for CUDA here: an answer left on the CPU would mix devices downstream.
    from kvcompress.strategies.sentences import lookup, vocab_table

    table = vocab_table((" a", ".", " b", "!"), (".", "!"))
    ids = torch.tensor([[0, 1, 2, 3, -1, 9]])
    assert lookup(table, ids).tolist() == [[False, True, False, True, False, False]]
    assert lookup(table, ids.to("meta")).device.type == "meta"
    assert sentence_ids(ids.to("meta"), (" a", ".", " b", "!")).device.type == "meta"
