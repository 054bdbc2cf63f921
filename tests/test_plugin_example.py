"""The example plugin (examples/plugin_example): found through the ``kvcompress.strategies`` entry
point and used by name from a pipeline config, never imported by the test.

CI installs it (``pip install -e examples/plugin_example``, see .ci/run); elsewhere these tests
skip with the command to run.
"""

from __future__ import annotations

import math
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvcompress as kc

PLUGIN = "windowed"  # entry-point name in examples/plugin_example/pyproject.toml
installed = any(ep.name == PLUGIN for ep in entry_points(group="kvcompress.strategies"))
pytestmark = pytest.mark.skipif(
    not installed, reason="the example plugin is not installed: pip install -e examples/plugin_example")

VOCAB = ("a", " b", " c", ".", " d")


def windowed(**params):
    """The plugin's clusterer, by registry name (the entry point imports the plugin on demand)."""
    return kc.CLUSTERERS.create("windowed-average", params)


def reference_plan(chunk_ids: torch.Tensor, valid: torch.Tensor, window: int) -> torch.Tensor:
    """Slow reference, one row at a time: walking the clusterable slots (valid, chunk id >= 0) in
    slot order, a run is a maximal stretch of them with the same chunk id (slots with id -1 are
    skipped, not run breakers, as chunkers treat protected slots); inside a run, members 0..k-1
    join member 0, k..2k-1 join member k, ... Other valid slots keep themselves; invalid get -1."""
    B, H, N = chunk_ids.shape
    parent = torch.full((B, H, N), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            run, prev = [], None
            runs = []
            for n in range(N):
                if valid[b, h, n]:
                    parent[b, h, n] = n
                c = int(chunk_ids[b, h, n])
                if valid[b, h, n] and c >= 0:
                    if run and c != prev:
                        runs.append(run)
                        run = []
                    run.append(n)
                    prev = c
            if run:
                runs.append(run)
            for run in runs:
                for i, n in enumerate(run):
                    parent[b, h, n] = run[i - i % window]
    return parent


def slots_with(chunk_ids, valid, window: int) -> int:
    parent = reference_plan(chunk_ids[None, None], valid[None, None], window)[0, 0]
    return int(((parent == torch.arange(len(parent))) & valid).sum())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fixed_window_equals_reference(data):
    H = data.draw(st.integers(1, 2))
    N = data.draw(st.integers(1, 40))
    window = data.draw(st.integers(1, 6))
    # chunk ids non-decreasing with -1 holes, as the Chunker protocol promises
    steps = data.draw(st.lists(st.integers(0, 1), min_size=N, max_size=N))
    holes = data.draw(st.lists(st.booleans(), min_size=N, max_size=N))
    base = torch.tensor(steps).cumsum(0)
    chunk = torch.where(torch.tensor(holes), -1, base).expand(1, H, N).clone()
    valid = torch.ones(1, H, N, dtype=torch.bool)
    state = kc.KVState.from_raw(torch.randn(1, H, N, 4), torch.randn(1, H, N, 4))
    plan = windowed(window=window)(state, chunk, torch.full((1, H), N), 0)
    assert torch.equal(plan.parent, reference_plan(chunk, valid, window))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_searched_window_is_the_smallest_that_fits(data):
    N = data.draw(st.integers(2, 48))
    cuts = data.draw(st.lists(st.integers(0, 1), min_size=N, max_size=N))
    chunk = torch.tensor(cuts).cumsum(0)
    target = data.draw(st.integers(1, N))
    state = kc.KVState.from_raw(torch.randn(1, 1, N, 4), torch.randn(1, 1, N, 4))
    plan = windowed()(state, chunk.view(1, 1, N), torch.tensor([[target]]), 0)
    valid = torch.ones(N, dtype=torch.bool)
    fits = [k for k in range(1, N + 1) if slots_with(chunk, valid, k) <= target]
    k = fits[0] if fits else N  # none fits: the largest window (one slot per run)
    assert torch.equal(plan.parent[0, 0], reference_plan(chunk.view(1, 1, N), valid.view(1, 1, N), k)[0, 0])


def toy_state(N=120, H=3, seed=0, every=10):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (2, N), generator=gen)
    ids[:, every - 1::every] = 3
    return kc.KVState.from_raw(torch.randn(2, H, N, 8, generator=gen), torch.randn(2, H, N, 8, generator=gen),
                               token_ids=ids, vocab=VOCAB)


def test_by_name_in_a_pipeline_config():
    state = toy_state()
    pipe = kc.Pipeline({"keep_ratio": 0.4, "sinks": 4, "recent": 8, "chunker": {"name": "delimiter"},
                        "clusterer": {"name": "windowed-average"}, "merger": {"name": "mean"}})
    out, report = pipe.compress(state, layer_idx=0)
    assert report.budget_met and (report.slots_per_head <= 48).all()
    assert torch.allclose(out.sizes().sum(-1), torch.full((2, 3), 120.0))
    # windows never cross a delimiter: every merged slot's members lie between two delimiters
    member = torch.eye(120).expand(2, 3, 120, 120).clone()
    tracked, _ = pipe.compress(state.replace(extras={"member": member}), 0)
    is_delim = state.token_ids == 3  # [B, N]
    for b in range(2):
        for h in range(3):
            for row in tracked.extras["member"][b, h]:
                who = row.nonzero().flatten()
                if len(who) > 1:
                    assert not is_delim[b, who[0]:who[-1] + 1].any()
                    assert who[-1] - who[0] + 1 == len(who)  # a window is contiguous here
    assert "windowed-average" in kc.list_strategies("windowed*")["clusterer"]


def test_preset_and_overrides():
    state = toy_state(seed=1)
    out, report = kc.Pipeline("windowed-average", keep_ratio=0.5, recent=8).compress(state)
    assert report.budget_met
    out, report = kc.Pipeline("windowed-average", recent=8, on_infeasible="best_effort",
                              **{"clusterer.window": 2}).compress(state)
    # a fixed window of 2 halves every run: ceil(run / 2) slots per run
    assert report.rounds == 1 and (report.slots_per_head > 60).all()


def test_min_slots_is_the_floor_reached():
    from kvcompress.decode import DecodeCompressor

    state = toy_state(seed=2)
    pipe = kc.Pipeline("windowed-average", keep_ratio=0.05, recent=8, on_infeasible="best_effort")
    _, report = pipe.compress(state)
    assert not report.budget_met
    floor = DecodeCompressor(pipe).floor(state)
    assert torch.equal(floor, report.slots_per_head)
    assert DecodeCompressor(pipe).scope == "all"


def test_bad_window():
    with pytest.raises(ValueError, match="window=0"):
        kc.Pipeline({"clusterer": {"name": "windowed-average", "params": {"window": 0}}})
    with pytest.raises(ValueError, match="unknown parameter"):
        kc.Pipeline({"clusterer": {"name": "windowed-average", "params": {"size": 4}}})


def test_found_without_any_import_in_a_fresh_process():
    code = (
        "import sys, torch, kvcompress\n"
        "assert 'kvcompress_windowed' not in sys.modules\n"
        "pipe = kvcompress.Pipeline({'keep_ratio': 0.5, 'sinks': 0, 'chunker': 'global',\n"
        "                            'clusterer': {'name': 'windowed-average'}, 'merger': 'mean'})\n"
        "state = kvcompress.KVState.from_raw(torch.randn(1, 1, 16, 4), torch.randn(1, 1, 16, 4))\n"
        "out, report = pipe.compress(state)\n"
        "assert 'kvcompress_windowed' in sys.modules and out.num_slots == 8\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")


def test_reference_helper_counts():
    # the reference itself: 10 slots in one chunk, window 3 -> ceil(10 / 3) = 4 slots
    assert slots_with(torch.zeros(10, dtype=torch.long), torch.ones(10, dtype=torch.bool), 3) == math.ceil(10 / 3)
