"""Delimiter, fixed and global chunkers."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import BPE_VOCAB, CORE_SETTINGS, DELIMITER_TEXTS, make_state
from kvcompress import Pipeline, PipelineConfig
from kvcompress.strategies.chunkers import DelimiterChunker, FixedSizeChunker, GlobalChunker, delimiter_mask
from kvcompress.types import KVState


def _state_with_ids(ids: list[int], H: int = 2, vocab=BPE_VOCAB) -> KVState:
    N = len(ids)
    keys = torch.randn(1, H, N, 4, generator=torch.Generator().manual_seed(N))
    return KVState.from_raw(keys, keys.clone(), token_ids=torch.tensor([ids]), vocab=vocab)


def test_fused_bpe_delimiters_are_anchors():
    texts = [BPE_VOCAB[i] for i in range(len(BPE_VOCAB))]
    ids = list(range(len(BPE_VOCAB)))
    state = _state_with_ids(ids)
    mask = delimiter_mask(state, DelimiterChunker().delimiters)
    expected = torch.tensor([t in DELIMITER_TEXTS for t in texts])
    assert torch.equal(mask[0, 0], expected)
    # the fused ones in particular
    for text in (".\n", " ,", "\n\n", "),"):
        assert bool(mask[0, 0, texts.index(text)])
    assert not bool(mask[0, 0, texts.index("hello")])


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), N=st.integers(1, 30), sinks=st.integers(0, 3))
def test_delimiter_chunk_ids_follow_the_text(seed, N, sinks):
    state = make_state(seed, B=1, H=2, N=N, with_membership=False)
    protected = (state.positions < sinks) & state.valid
    ids = DelimiterChunker()(state, protected)
    anchors_seen = 0
    for n in range(N):
        text = BPE_VOCAB[int(state.token_ids[0, n])]
        is_delim = text in DELIMITER_TEXTS
        if is_delim:
            anchors_seen += 1
        expected = -1 if (is_delim or n < sinks) else anchors_seen
        assert ids[0, :, n].tolist() == [expected] * 2, (n, text)


def test_anchors_are_never_merged():
    ids = [0, 1, 5, 6, 2, 8, 11, 3, 12, 14, 4, 0, 16, 17, 19, 1, 0, 6, 8, 11]
    state = _state_with_ids(ids)
    cfg = PipelineConfig(keep_ratio=0.05, sinks=0, recent=0, chunker={"name": "delimiter"},
                         on_infeasible="best_effort")
    out, report = Pipeline(cfg).compress(state)
    assert not report.budget_met  # the anchors alone exceed one slot
    for n, i in enumerate(ids):
        if BPE_VOCAB[i] in DELIMITER_TEXTS:
            for h in range(2):
                m = (out.positions[0, h] == n).nonzero()
                assert m.numel() == 1, (n, BPE_VOCAB[i])
                m = int(m[0, 0])
                assert float(out.log_sizes[0, h, m]) == 0.0
                assert torch.equal(out.keys[0, h, m], state.keys[0, h, n])
    # between anchors everything collapsed: anchors + one slot per non-empty run
    runs, current = 0, 0
    for i in ids:
        if BPE_VOCAB[i] in DELIMITER_TEXTS:
            runs += current > 0
            current = 0
        else:
            current += 1
    runs += current > 0
    anchors = sum(BPE_VOCAB[i] in DELIMITER_TEXTS for i in ids)
    assert out.valid.sum(-1).tolist() == [[anchors + runs] * 2]


def test_explicit_delimiter_ids_override_the_vocab():
    state = _state_with_ids([0, 1, 0, 0, 5])  # "hello", " world", ...
    ids = DelimiterChunker(delimiter_ids=(1,))(state, torch.zeros(1, 2, 5, dtype=torch.bool))
    assert ids[0, 0].tolist() == [0, -1, 1, 1, 1]


def test_fixed_chunker_by_tokens_and_by_slots():
    state = make_state(0, B=1, H=1, N=10, pad=[2], with_membership=False)
    protected = torch.zeros(1, 1, 10, dtype=torch.bool)
    protected[0, 0, 4] = True
    by_tokens = FixedSizeChunker(size=3)(state, protected)
    # positions 2..9 are real; relative 0..7 -> chunks 0,0,(protected),1,1,1,2,2
    assert by_tokens[0, 0].tolist() == [-1, -1, 0, 0, -1, 1, 1, 1, 2, 2]
    by_slots = FixedSizeChunker(size=3, by="slots")(state, protected)
    assert by_slots[0, 0].tolist() == [-1, -1, 0, 0, -1, 0, 1, 1, 1, 2]


def test_global_chunker_is_one_chunk_of_the_clusterable_slots():
    state = make_state(0, B=1, H=2, N=6, pad=[1], with_membership=False)
    protected = torch.zeros(1, 2, 6, dtype=torch.bool)
    protected[0, 1, 3] = True
    ids = GlobalChunker()(state, protected)
    assert ids[0].tolist() == [[-1, 0, 0, 0, 0, 0], [-1, 0, 0, -1, 0, 0]]
