"""Typed per-call arguments of ``Pipeline.compress`` (``protect``, ``target_floor``) against the
extension by subclassing and hidden ``extras`` keys that they replace (kept here as the reference):
decode-time compressions and the evaluation's oracle protection / needle marks give the same
states, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvcompress import KVState, Pipeline
from kvcompress.decode import FRONTIER_KEY, DecodeCompressor, append_tokens
from kvcompress.eval.caches import MARK_PREFIX, Recorder, compressed_copy, trace_mark

from conftest import make_state
from test_eval_helpers import TEXT, tiny_model, tiny_tokenizer

_BUDGET, _WINDOW = "_ref_budget", "_ref_window"


class _OldBudgeted(Pipeline):
    """The reference: the budget read from ``extras``, the tail window frozen by recomputing the
    window from the current positions in every round (the former ``decode-window`` guard)."""

    def target_slots(self, state, layer_idx=None):
        target = super().target_slots(state, layer_idx)
        budget = state.extras.get(_BUDGET)
        return target if budget is None else torch.maximum(target, budget)

    def protection(self, state, layer_idx=None, **window):
        protected = super().protection(state, layer_idx, **window)
        window = state.extras.get(_WINDOW)
        if window is None:
            return protected
        lo, hi = (w[:, None, None] for w in window)
        return protected | (state.valid & ((state.positions < lo) | (state.positions >= hi)))


def _old_decode_compress(dc: DecodeCompressor, state: KVState, layer_idx: int):
    """DecodeCompressor.compress as it was written with hidden keys (same attempts, same order)."""
    cfg = dc.pipeline.config
    budget = dc.budget(state, layer_idx)
    B = state.batch_size
    window_start = torch.full((B,), state.num_tokens - cfg.recent, dtype=torch.long).clamp(min=0)
    frontier = state.extras.get(FRONTIER_KEY, torch.zeros(B, dtype=torch.long))
    if bool((state.valid.sum(-1) <= budget).all()):
        return state
    base = state.replace(extras={**state.extras, _BUDGET: budget})

    def finish(out, f):
        extras = {k: v for k, v in out.extras.items() if k not in (_BUDGET, _WINDOW)}
        return out.replace(extras={**extras, FRONTIER_KEY: f})

    if dc.scope == "tail":
        tail = _OldBudgeted(cfg.replace(on_infeasible="best_effort"))
        for lo, hi, new_frontier in dc._tail_attempts(state, frontier, window_start):
            if not bool((hi > lo).any()):
                continue
            out, report = tail.compress(base.replace(extras={**base.extras, _WINDOW: (lo, hi)}), layer_idx)
            if report.budget_met:
                return finish(out, torch.maximum(frontier, new_frontier))
    out, _ = _OldBudgeted(cfg).compress(base, layer_idx)
    return finish(out, torch.maximum(frontier, window_start))


def _assert_same(a: KVState, b: KVState):
    assert a.num_slots == b.num_slots and a.num_tokens == b.num_tokens
    for name in ("keys", "values", "log_sizes", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.protected is None) == (b.protected is None)
    if a.protected is not None:
        assert torch.equal(a.protected, b.protected)
    assert sorted(a.stats) == sorted(b.stats)
    for name in a.stats:
        assert torch.equal(a.stats[name], b.stats[name]), name
    assert torch.equal(a.extras[FRONTIER_KEY], b.extras[FRONTIER_KEY])


@pytest.mark.parametrize("preset", ["semanticache", "semanticache-fixed64", "centroidkv", "streamingllm",
                                    "semanticache-safe", "centroidkv-safe",
                                    "snapkv"])
def test_decode_compressions_agree_with_the_hidden_key_reference(preset):
    """Prefill, then decode steps with compression every g tokens: the typed path and the
    reference keep the same slots at every step (tail attempts included)."""
    cfg = Pipeline(preset).config.replace(keep_ratio=0.3, sinks=2, recent=6, recompress_every=4,
                                          on_infeasible="best_effort")
    pipe = Pipeline(cfg)
    dc_new, dc_old = DecodeCompressor(pipe), DecodeCompressor(Pipeline(cfg))
    state = make_state(3, B=2, H=2, N=64, D=8, with_membership=True, pad=[0, 5])
    queries = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(2))  # for scorers / guards
    state = state.replace(extras={"queries": queries, "reference_queries": queries})
    new = old = state
    gen = torch.Generator().manual_seed(1)
    compressions = 0
    for step in range(40):
        if step:
            k, v = torch.randn(2, 2, 1, 8, generator=gen), torch.randn(2, 2, 1, 8, generator=gen)
            ids = torch.randint(0, len(state.vocab), (2, 1), generator=gen)
            new, old = append_tokens(new, k, v, ids), append_tokens(old, k, v, ids)
        if step == 0 or dc_new.should_compress(new, 0):
            assert step == 0 or dc_old.should_compress(old, 0)
            new, _ = dc_new.compress(new, 0)
            old = _old_decode_compress(dc_old, old, 0)
            compressions += 1
            _assert_same(new, old)
    assert compressions >= 3


def test_protect_holds_for_the_call_and_keeps_the_states_own():
    """protect keeps its slots whole through every round; the result's ``protected`` is the
    state's own protection carried through the merge, never the call's."""
    own = torch.zeros(2, 2, 48, dtype=torch.bool)
    own[:, :, 10] = True
    state = make_state(5, B=2, H=2, N=48, protected=own)
    extra = torch.zeros_like(own)
    extra[:, :, 20:26] = True
    pipe = Pipeline("semanticache-fixed64", keep_ratio=0.2, sinks=1, recent=4, on_infeasible="best_effort")
    out, _ = pipe.compress(state, 0, protect=extra)
    reference, _ = pipe.compress(state.replace(protected=own | extra), 0)
    for name in ("keys", "values", "log_sizes", "positions"):
        assert torch.equal(getattr(out, name), getattr(reference, name))
    single = out.sizes() == 1
    for p in [10, *range(20, 26)]:
        assert bool(((out.positions == p) & single).any(-1).all())
    assert torch.equal(out.protected, out.valid & (out.positions == 10))
    plain = make_state(5, B=2, H=2, N=48)
    assert pipe.compress(plain, 0, protect=extra)[0].protected is None


def test_target_floor_raises_the_target():
    state = make_state(2, B=1, H=2, N=64)
    pipe = Pipeline("centroidkv", keep_ratio=0.25, sinks=1, recent=4)
    floor = torch.tensor([[30, 40]])
    out, report = pipe.compress(state, 0, target_floor=floor)
    assert torch.equal(report.target, torch.maximum(pipe.target_slots(state, 0), floor))
    assert bool((out.valid.sum(-1) <= report.target).all())
    with pytest.raises(ValueError, match="target_floor"):
        pipe.compress(state, 0, target_floor=torch.tensor([30, 40]))
    with pytest.raises(ValueError, match="protect"):
        pipe.compress(state, 0, protect=torch.zeros(1, 2, 63, dtype=torch.bool))


class _OldEvalPipeline(Pipeline):
    """The reference for the evaluation's oracle: the former subclass (span protection through
    ``state.protected`` and needle marks added as stats inside ``compress``)."""

    def __init__(self, config, protect=(), marks=None):
        super().__init__(config)
        self.protect, self.marks, self.traces = tuple(protect), dict(marks or {}), {}

    def compress(self, state, layer_idx=None, **kwargs):
        pos = state.positions
        stats = dict(state.stats)
        for name, (a, b) in self.marks.items():
            stats[MARK_PREFIX + name] = ((pos >= a) & (pos < b)).float()
        protected = state.protected
        for a, b in self.protect:
            span = state.valid & (pos >= a) & (pos < b)
            protected = span if protected is None else protected | span
        out, report = super().compress(state.replace(stats=stats, protected=protected), layer_idx)
        self.traces[layer_idx] = {name: trace_mark(out, out.stats[MARK_PREFIX + name], b - a)
                                  for name, (a, b) in self.marks.items()}
        clean = {k: v for k, v in out.stats.items() if not k.startswith(MARK_PREFIX)}
        return out.replace(stats=clean, protected=None), report


@pytest.mark.parametrize("preset", ["semanticache", "centroidkv", "semanticache-safe", "snapkv"])
def test_eval_oracle_copies_agree_with_the_subclass_reference(preset):
    from kvcompress.eval.caches import as_needed
    from kvcompress.hf import CompressedCache

    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :160]
    cfg = Pipeline(preset).config.replace(keep_ratio=0.3, recent=8, sinks=2)
    rec = Recorder(model, tok, needs=Pipeline(cfg).needs, backend="sdpa")
    rec.feed(ids)
    snap = rec.snapshot()
    rec.close()
    span, marks = (60, 72), {"needle": (60, 72), "other": (100, 110)}
    new = compressed_copy(model, snap, cfg, protect=[span], marks=marks)
    old_pipe = _OldEvalPipeline(cfg, protect=[span], marks=marks)
    old = CompressedCache.from_states([as_needed(s, old_pipe.needs, preset) for s in snap.states], old_pipe,
                                      vocab=snap.vocab, backend="sdpa", geometry=snap.geometry)
    with torch.inference_mode():
        old.compress()
    for i in old.compressed_layer_ids():
        a, b = new.cache.layer_state(i), old.layer_state(i)
        for name in ("keys", "values", "log_sizes", "positions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (i, name)
        assert sorted(a.stats) == sorted(b.stats)  # the marks are gone after tracing
    for name in marks:
        rows = [t[name] for t in old_pipe.traces.values()]
        for key in ("kept", "alone", "mixed", "slots", "size"):
            assert new.trace[name][key] == sum(r[key] for r in rows) / len(rows)
    assert new.trace["needle"]["alone"] == 1.0
    new.cache.close()
