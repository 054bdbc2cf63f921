"""Decode-time compression: slot counts stay within budget + g over long generations, the tail-only
path leaves compressed slots alone, and bad budgets fail up front."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress as kc
from kvcompress.decode import FRONTIER_KEY, DecodeCompressor, append_tokens

# A toy vocabulary: ids 0-3 are delimiters (".", ",", "\n", "!"), the rest words.
VOCAB = (".", ",", "\n", " !") + tuple(f" w{i}" for i in range(46))
DELIMS = 4


def toy_tokens(gen: torch.Generator, B: int, n: int, delim_rate: float = 0.12) -> torch.Tensor:
    words = torch.randint(DELIMS, len(VOCAB), (B, n), generator=gen)
    delims = torch.randint(0, DELIMS, (B, n), generator=gen)
    return torch.where(torch.rand(B, n, generator=gen) < delim_rate, delims, words)


def walk_keys(gen, B, H, n, D, prev=None):
    """Locally similar keys (a random walk), like real caches."""
    steps = 0.3 * torch.randn(B, H, n, D, generator=gen)
    start = torch.randn(B, H, 1, D, generator=gen) if prev is None else prev
    return start + steps.cumsum(2)


def generate(compressor: DecodeCompressor, state: kc.KVState, steps: int, gen, with_ids: bool):
    """Append one token per step; compress when asked. Returns the per-step (slots - budget) maximum."""
    B, H, _, D = state.keys.shape
    worst = -10**9
    compressions = 0
    last = state.keys[:, :, -1:]
    for _ in range(steps):
        k = last + 0.3 * torch.randn(B, H, 1, D, generator=gen)
        last = k
        ids = toy_tokens(gen, B, 1) if with_ids else None
        state = append_tokens(state, k, torch.randn(B, H, 1, D, generator=gen), ids)
        if compressor.should_compress(state):
            state, report = compressor.compress(state)
            compressions += 1
            assert report.budget_met
            assert bool((state.valid.sum(-1) <= report.target).all())
        slots = state.valid.sum(-1)
        over = slots - compressor.pipeline.target_slots(state)
        if int(over.max()) > compressor.g:  # the budget is >= the target: only then look closer
            over = slots - compressor.budget(state)
        worst = max(worst, int(over.max()))
        assert torch.allclose(state.log_sizes.exp().sum(-1), state.real_tokens()[:, None].float()
                              .expand_as(slots), rtol=1e-4)
    return state, worst, compressions


def test_centroidkv_long_generation_stays_within_budget_plus_g():
    gen = torch.Generator().manual_seed(0)
    B, H, D = 2, 2, 16
    pipe = kc.Pipeline("centroidkv", keep_ratio=0.25, recompress_every=32, **{"chunker.size": 64})
    comp = DecodeCompressor(pipe)
    assert comp.scope == "all"
    prompt = kc.KVState.from_raw(walk_keys(gen, B, H, 400, D), torch.randn(B, H, 400, D, generator=gen))
    state, _ = comp.compress(prompt)
    state, worst, n = generate(comp, state, 1200, gen, with_ids=False)
    assert worst <= comp.g
    assert n >= 10
    assert state.num_tokens == 1600
    assert int(state.valid.sum(-1).max()) <= 400 + 32


def test_semanticache_long_generation_stays_within_budget_plus_g():
    gen = torch.Generator().manual_seed(1)
    B, H, D = 1, 2, 16
    pipe = kc.Pipeline("semanticache", keep_ratio=0.5, recompress_every=24)
    comp = DecodeCompressor(pipe)
    assert comp.scope == "tail"
    ids = toy_tokens(gen, B, 300)
    prompt = kc.KVState.from_raw(walk_keys(gen, B, H, 300, D), torch.randn(B, H, 300, D, generator=gen),
                                 token_ids=ids, vocab=VOCAB)
    state, _ = comp.compress(prompt)
    assert FRONTIER_KEY in state.extras
    state, worst, n = generate(comp, state, 1100, gen, with_ids=True)
    assert worst <= comp.g
    assert n >= 10
    assert int(state.extras[FRONTIER_KEY][0]) > 1000  # the frontier followed the generation


def frozen_view(state, frontier):
    """Per head, the slots before the frontier: (keys, values, log_sizes, positions)."""
    keep = (state.positions < frontier) & state.valid
    return [(state.keys[0, h][keep[0, h]], state.log_sizes[0, h][keep[0, h]], state.positions[0, h][keep[0, h]])
            for h in range(state.num_heads)]


def test_tail_compression_leaves_compressed_slots_alone():
    gen = torch.Generator().manual_seed(2)
    H, D = 2, 8
    pipe = kc.Pipeline("semanticache", keep_ratio=0.5, recompress_every=16)
    comp = DecodeCompressor(pipe)
    ids = toy_tokens(gen, 1, 200)
    state = kc.KVState.from_raw(walk_keys(gen, 1, H, 200, D), torch.randn(1, H, 200, D, generator=gen),
                                token_ids=ids, vocab=VOCAB)
    state, _ = comp.compress(state)
    tail_steps = 0
    for _ in range(300):
        state = append_tokens(state, walk_keys(gen, 1, H, 1, D, state.keys[:, :, -1:]),
                              torch.randn(1, H, 1, D, generator=gen), toy_tokens(gen, 1, 1))
        if comp.should_compress(state):
            frontier = int(state.extras[FRONTIER_KEY][0])
            before = frozen_view(state, frontier)
            new, report = comp.compress(state)
            after = frozen_view(new, frontier)
            same = all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))
            tail_steps += same
            state = new
    assert tail_steps >= 5


def test_open_run_waits_for_its_delimiter():
    """With the delimiter chunker the tokens after the last delimiter (before the recent window)
    stay raw: the next delimiter will close their chunk."""
    H, D, N = 1, 8, 120
    gen = torch.Generator().manual_seed(3)
    ids = torch.full((1, N), 10)
    ids[0, 20] = 0  # one delimiter: chunk [4, 20) is complete, [21, window) is open
    pipe = kc.Pipeline("semanticache", keep_ratio=0.9, recent=32)
    comp = DecodeCompressor(pipe)
    keys = torch.randn(1, H, 1, D, generator=gen).expand(1, H, N, D).clone()  # identical: GSC merges all
    state = kc.KVState.from_raw(keys, torch.randn(1, H, N, D, generator=gen), token_ids=ids, vocab=VOCAB)
    out, report = comp.compress(state)
    assert report.budget_met
    assert int(out.extras[FRONTIER_KEY][0]) == 21
    assert bool((out.log_sizes[0, 0][(out.positions[0, 0] >= 21)] == 0).all())  # open run untouched
    # a budget the completed chunks cannot meet falls back to the open run as well
    out2, report2 = DecodeCompressor(kc.Pipeline("semanticache", keep_ratio=0.5, recent=32)).compress(state)
    assert report2.budget_met and int(out2.extras[FRONTIER_KEY][0]) == N - 32


def test_tail_falls_back_to_whole_cache_when_tail_cannot_meet_budget():
    H, D = 1, 8
    gen = torch.Generator().manual_seed(4)
    pipe = kc.Pipeline("semanticache", keep_ratio=0.5, recent=8, sinks=2, recompress_every=16)
    comp = DecodeCompressor(pipe)
    ids = torch.full((1, 100), 10)
    state = kc.KVState.from_raw(torch.randn(1, H, 100, D, generator=gen), torch.randn(1, H, 100, D, generator=gen),
                                token_ids=ids, vocab=VOCAB)
    state, _ = comp.compress(state)
    # 60 new delimiters: the tail is all anchors and cannot shrink, only the old part can
    for _ in range(60):
        state = append_tokens(state, torch.randn(1, H, 1, D, generator=gen), torch.randn(1, H, 1, D, generator=gen),
                              torch.zeros(1, 1, dtype=torch.long))
    assert comp.should_compress(state)
    out, report = comp.compress(state)
    assert report.budget_met
    assert int(out.valid.sum()) <= int(comp.budget(out).max())


def test_budget_floor_while_few_tokens_seen():
    """keep_ratio * T below sinks + recent early in a generation raises the budget to the floor."""
    pipe = kc.Pipeline("centroidkv", keep_ratio=0.1, recompress_every=8)
    comp = DecodeCompressor(pipe)
    gen = torch.Generator().manual_seed(5)
    state = kc.KVState.from_raw(torch.randn(1, 2, 20, 8, generator=gen), torch.randn(1, 2, 20, 8, generator=gen))
    state, worst, n = generate(comp, state, 150, gen, with_ids=False)
    assert worst <= comp.g and n > 0
    assert int(comp.budget(state).max()) >= 16 + 64 + 1


@settings(max_examples=8, deadline=None)
@given(keep=st.floats(0.2, 0.8), g=st.integers(4, 40), seed=st.integers(0, 100),
       name=st.sampled_from(["centroidkv", "centroidkv-chunk16", "semanticache", "semanticache-fixed64"]))
def test_within_budget_plus_g_any_method(keep, g, seed, name):
    gen = torch.Generator().manual_seed(seed)
    comp = DecodeCompressor(kc.Pipeline(name, keep_ratio=keep, recompress_every=g))
    ids = toy_tokens(gen, 1, 100)
    state = kc.KVState.from_raw(walk_keys(gen, 1, 2, 100, 8), torch.randn(1, 2, 100, 8, generator=gen),
                                token_ids=ids, vocab=VOCAB)
    _, worst, _ = generate(comp, state, 120, gen, with_ids=True)
    assert worst <= g


def test_full_heads_are_never_compressed_while_decoding():
    gen = torch.Generator().manual_seed(6)
    comp = DecodeCompressor(kc.Pipeline("centroidkv", keep_ratio=0.3, recompress_every=16, full_heads=[[0, 1]]))
    state = kc.KVState.from_raw(torch.randn(1, 2, 200, 8, generator=gen), torch.randn(1, 2, 200, 8, generator=gen))
    for _ in range(100):
        state = append_tokens(state, torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen))
        if comp.should_compress(state, layer_idx=0):
            state, _ = comp.compress(state, layer_idx=0)
    assert int(state.valid[0, 1].sum()) == 300
    assert int(state.valid[0, 0].sum()) <= 90 + 16


def test_bad_input():
    with pytest.raises(ValueError, match="max_slots"):
        DecodeCompressor(kc.Pipeline("centroidkv", max_slots=80))
    with pytest.raises(ValueError, match="scope"):
        DecodeCompressor(kc.Pipeline("centroidkv"), scope="some")
    with pytest.raises(ValueError, match="pipeline"):
        DecodeCompressor("centroidkv")
    state = kc.KVState.from_raw(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8))
    with pytest.raises(ValueError, match="keys"):
        append_tokens(state, torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8))
    with pytest.raises(ValueError, match="values"):
        append_tokens(state, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 2, 8))


def test_unreachable_budget_is_raised_to_the_floor():
    """A cap below what the method can reach (here: every token a delimiter anchor) becomes the
    floor instead of an error in the middle of a generation."""
    comp = DecodeCompressor(kc.Pipeline("semanticache", max_slots=40, sinks=2, recent=4, fallback_chunker=None),
                            scope="all")
    ids = torch.zeros(1, 100, dtype=torch.long)  # every token a delimiter anchor
    state = kc.KVState.from_raw(torch.randn(1, 1, 100, 8), torch.randn(1, 1, 100, 8), token_ids=ids, vocab=VOCAB)
    keys = state.keys.clone()
    # the floor (all anchors) lifts the budget to what is reachable: nothing to do, nothing raised
    out, report = comp.compress(state)
    assert report.budget_met and out is state and torch.equal(state.keys, keys)
    # with SemantiCache's fallback below the anchor floor the floor is the cap itself, and it is met
    below = DecodeCompressor(kc.Pipeline("semanticache", max_slots=40, sinks=2, recent=4,
                                         on_infeasible="best_effort"), scope="all")
    assert int(below.floor(state).max()) <= 40
    out, report = below.compress(state)
    assert report.budget_met and int(out.valid.sum(-1).max()) <= 40 and torch.equal(state.keys, keys)


def lockstep(name, keep, g, recent, seed, steps, delim_rate=0.3):
    """Decode with and without the floor memo from one prompt, same tokens: every decision and
    every state must match. Returns (floor passes with the memo, without, compressions)."""
    gen = torch.Generator().manual_seed(seed)
    # the memo follows the chunker's floor; a fallback below it (SemantiCache's default) turns it off
    pipe = kc.Pipeline(name, keep_ratio=keep, recompress_every=g, recent=recent, fallback_chunker=None)
    fast, slow = DecodeCompressor(pipe), DecodeCompressor(pipe)
    assert fast._floors is not None
    slow._floors = None  # the reference: the floor recomputed at every call
    calls = {"fast": 0, "slow": 0}

    def counting(comp, tag):
        inner = comp.floor

        def floor(state, layer_idx=None):
            calls[tag] += 1
            return inner(state, layer_idx)
        comp.floor = floor

    counting(fast, "fast")
    counting(slow, "slow")
    B, H, D = 2, 2, 8
    ids = toy_tokens(gen, B, 160, delim_rate)
    prompt = kc.KVState.from_raw(walk_keys(gen, B, H, 160, D), torch.randn(B, H, 160, D, generator=gen),
                                 token_ids=ids, vocab=VOCAB)
    a, _ = fast.compress(prompt, layer_idx=0)
    b, _ = slow.compress(prompt, layer_idx=0)
    compressions = 0
    for _ in range(steps):
        k = walk_keys(gen, B, H, 1, D, a.keys[:, :, -1:])
        v = torch.randn(B, H, 1, D, generator=gen)
        t = toy_tokens(gen, B, 1, delim_rate)
        a, b = append_tokens(a, k, v, t), append_tokens(b, k, v, t)
        decide = fast.should_compress(a, layer_idx=0)
        assert decide == slow.should_compress(b, layer_idx=0)
        if decide:
            compressions += 1
            a, ra = fast.compress(a, layer_idx=0)
            b, rb = slow.compress(b, layer_idx=0)
            assert torch.equal(ra.target, rb.target)
        for x, y in ((a.keys, b.keys), (a.values, b.values), (a.log_sizes, b.log_sizes), (a.positions, b.positions)):
            assert torch.equal(x, y)
    return calls["fast"], calls["slow"], compressions


def test_floor_memo_gives_identical_decisions_and_states_with_fewer_floor_passes():
    # keep 0.1 with 30 % delimiters is unreachable: the layer stays above target + g, where the
    # floor decides every step
    fast, slow, compressions = lockstep("semanticache", keep=0.1, g=8, recent=8, seed=11, steps=160)
    assert compressions >= 3
    assert slow >= 100  # the reference pays a whole-cache pass at almost every step
    assert fast * 2 <= slow


@settings(max_examples=6, deadline=None)
@given(keep=st.floats(0.05, 0.6), g=st.integers(1, 12), recent=st.integers(0, 6), seed=st.integers(0, 50),
       name=st.sampled_from(["semanticache", "semanticache-fixed64", "semanticache-global"]))
def test_floor_memo_is_exact_for_every_monotone_chunker(keep, g, recent, seed, name):
    lockstep(name, keep, g, recent, seed, steps=60)


def test_floor_memo_rejects_a_state_that_does_not_extend_the_remembered_one():
    pipe = kc.Pipeline("semanticache", keep_ratio=0.05, recompress_every=2, sinks=0, recent=0, fallback_chunker=None)
    comp = DecodeCompressor(pipe)
    words = torch.full((1, 40), 10, dtype=torch.long)  # one chunk: the floor is 1
    delims = torch.zeros(1, 40, dtype=torch.long)  # every token an anchor: the floor is 40
    keys, values = torch.randn(1, 1, 40, 8), torch.randn(1, 1, 40, 8)
    anchors = kc.KVState.from_raw(keys, values, token_ids=delims, vocab=VOCAB)
    assert not comp.should_compress(anchors)  # 40 slots <= max(target 2, floor 40) + 2; floor remembered
    words_only = kc.KVState.from_raw(keys, values, token_ids=words, vocab=VOCAB)
    # same shapes, positions and slots, other tokens: the remembered floor (40) must not be used
    assert comp.should_compress(words_only)
    assert DecodeCompressor(pipe)._floors is not None
    assert DecodeCompressor(kc.Pipeline("semanticache"))._floors is None  # the fallback's floor follows the target
    assert DecodeCompressor(kc.Pipeline("centroidkv"))._floors is None  # CSM has its own min_slots
