"""Bad input: a ValueError that names the parameter, the value and what is allowed, raised before
anything changes (the input state is bit-for-bit the same afterwards)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_state_unchanged, clone_state, make_state
from kvcompress import BudgetError, KVState, Pipeline, PipelineConfig, get_preset
from kvcompress.strategies.chunkers import FixedSizeChunker
from kvcompress.strategies.gsc import GreedySeedClustering
from kvcompress.strategies.mergers import MeanMerger


@pytest.mark.parametrize("stage,name", [("chunker", "sentences"), ("clusterer", "kmeans++"), ("merger", "median")])
def test_unknown_strategy_names(stage, name):
    with pytest.raises(ValueError) as info:
        Pipeline("semanticache", **{stage: name})
    msg = str(info.value)
    assert f"{stage}={name!r}" in msg and "known" in msg


@pytest.mark.parametrize("tau", [1.5, -1.01, math.nan, "0.5", True])
def test_tau_outside_minus_one_one(tau):
    with pytest.raises(ValueError) as info:
        Pipeline("semanticache", **{"clusterer.tau": tau})
    msg = str(info.value)
    assert "tau=" in msg and "[-1.0, 1.0]" in msg


@pytest.mark.parametrize("keep", [0.0, -0.1, 1.5, math.nan, math.inf, True, "0.5"])
def test_keep_ratio_outside_zero_one(keep):
    with pytest.raises(ValueError) as info:
        get_preset("semanticache", keep_ratio=keep)
    msg = str(info.value)
    assert "keep_ratio=" in msg and "(0.0, 1.0]" in msg


@pytest.mark.parametrize("slots", [0, -3, 2.5, True])
def test_max_slots_must_be_a_positive_int(slots):
    with pytest.raises(ValueError, match=r"max_slots=.* an integer >= 1"):
        PipelineConfig(max_slots=slots)


@pytest.mark.parametrize("field,value,allowed", [
    ("sinks", -1, "integer >= 0"), ("recent", 1.5, "integer >= 0"), ("max_rounds", 0, "integer >= 1"),
    ("on_infeasible", "ignore", "best_effort"), ("recompress_every", 0, "integer >= 1"),
])
def test_other_config_fields(field, value, allowed):
    with pytest.raises(ValueError) as info:
        PipelineConfig(**{field: value})
    assert f"{field}=" in str(info.value) and allowed in str(info.value)


@pytest.mark.parametrize("make,match", [
    (lambda: GreedySeedClustering(search_width=0), "search_width=0"),
    (lambda: FixedSizeChunker(size=0), "size=0"),
    (lambda: FixedSizeChunker(by="words"), "by='words'"),
    (lambda: MeanMerger(weighting="median"), "weighting='median'"),
])
def test_strategy_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _bad_states():
    """(description, state built without validation, expected message fragment)."""
    good = make_state(0, B=2, H=2, N=12, with_membership=False)
    k, v = good.keys, good.values
    nan_k = k.clone()
    nan_k[1, 0, 3, 2] = float("nan")
    inf_v = v.clone()
    inf_v[0, 1, 5, 0] = float("inf")
    meta_v = torch.empty_like(v, device="meta")
    return [
        ("nan keys", good.replace(keys=nan_k), "keys contains NaN"),
        ("inf values", good.replace(values=inf_v), "values contains inf"),
        ("values shape", good.replace(values=v[:, :, :10]), "values=(2, 2, 10, 8)"),
        ("values dtype", good.replace(values=v.half()), "values.dtype=torch.float16"),
        ("int keys", good.replace(keys=k.long(), values=v.long()), "keys.dtype=torch.int64"),
        ("log_sizes shape", good.replace(log_sizes=good.log_sizes[:, :1]), "log_sizes=(2, 1, 12)"),
        ("log_sizes dtype", good.replace(log_sizes=good.log_sizes.double()), "log_sizes.dtype=torch.float64"),
        ("positions shape", good.replace(positions=good.positions[..., :5]), "positions=(2, 2, 5)"),
        ("token_ids rows", good.replace(token_ids=good.token_ids[:1]), "token_ids=(1, 12)"),
        ("protected dtype", good.replace(protected=torch.zeros(2, 2, 12)), "protected="),
        ("values device", good.replace(values=meta_v), "values.device='meta'"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_states())))
def test_bad_states_are_rejected_before_anything_changes(case):
    what, state, fragment = _bad_states()[case]
    snapshot = clone_state(state) if what != "values device" else None
    with pytest.raises(ValueError) as info:
        Pipeline("semanticache", keep_ratio=0.5, sinks=1, recent=1).compress(state)
    assert fragment in str(info.value), (what, str(info.value))
    if snapshot is not None:
        assert_state_unchanged(state, snapshot)


def test_from_raw_checks_its_arguments():
    k = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"keys=\(2, 6, 4\) is invalid: expected a 4-d tensor"):
        KVState.from_raw(k[0], k[0])
    with pytest.raises(ValueError, match=r"attention_mask=\(1, 5\) is invalid: expected shape \(1, 6\)"):
        KVState.from_raw(k, k, attention_mask=torch.ones(1, 5))
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="keys contains NaN"):
        KVState.from_raw(bad, k)


def test_delimiter_chunker_needs_token_ids_and_vocab():
    state = make_state(1, B=1, H=2, N=10, with_membership=False)
    snapshot = clone_state(state)
    with pytest.raises(ValueError, match=r"token_ids=None is invalid: expected token ids"):
        Pipeline("semanticache", keep_ratio=0.5, sinks=0, recent=0).compress(state.replace(token_ids=None))
    with pytest.raises(ValueError, match=r"vocab=None is invalid"):
        Pipeline("semanticache", keep_ratio=0.5, sinks=0, recent=0).compress(state.replace(vocab=None))
    assert_state_unchanged(state, snapshot)
    # the fixed chunker needs neither
    Pipeline("semanticache-fixed64", keep_ratio=0.5, sinks=0, recent=0).compress(state.replace(token_ids=None))


@pytest.mark.parametrize("budget,name", [({"keep_ratio": 0.1}, "keep_ratio=0.1"), ({"max_slots": 2}, "max_slots=2")])
def test_infeasible_budget_raises_budget_error(budget, name):
    state = make_state(2, B=1, H=2, N=20, with_membership=False)
    snapshot = clone_state(state)
    pipe = Pipeline("semanticache", sinks=4, recent=4, on_infeasible="error", fallback_chunker=None, **budget)
    with pytest.raises(BudgetError) as info:
        pipe.compress(state)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert name in msg and "best_effort" in msg and "sinks=4" in msg
    assert_state_unchanged(state, snapshot)
    out, report = Pipeline("semanticache", sinks=4, recent=4, on_infeasible="best_effort", fallback_chunker=None,
                           **budget).compress(state)
    assert not report.budget_met and bool((report.slots_per_head > report.target).any())


def test_layer_idx_and_full_heads_are_checked():
    state = make_state(2, B=1, H=2, N=10, with_membership=False)
    with pytest.raises(ValueError, match="layer_idx=-1"):
        Pipeline("semanticache-fixed64").compress(state, layer_idx=-1)
    with pytest.raises(ValueError, match="full_heads"):
        Pipeline("semanticache-fixed64", full_heads=[[0, 5]]).compress(state, layer_idx=0)
    with pytest.raises(ValueError, match="full_heads"):
        PipelineConfig(full_heads=[[0]])


def test_not_a_state():
    with pytest.raises(ValueError, match="state='Tensor' is invalid: expected a KVState"):
        Pipeline("semanticache").compress(torch.zeros(1, 1, 2, 2))


def test_attention_mask_must_be_left_padding():
    k = torch.randn(2, 1, 4, 3)
    with pytest.raises(ValueError, match="attention_mask=.* left padding only"):
        KVState.from_raw(k, k, attention_mask=torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask=.* left padding only"):
        KVState.from_raw(k, k, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 0, 1]]))
    state = KVState.from_raw(k, k, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
    assert state.seq_start.tolist() == [0, 2] and state.real_tokens().tolist() == [4, 2]


def test_positions_and_token_ids_must_be_long():
    state = make_state(0, B=1, H=1, N=4, with_membership=False)
    with pytest.raises(ValueError, match="positions.dtype=torch.int32"):
        state.replace(positions=state.positions.int()).validate()
    with pytest.raises(ValueError, match="token_ids.dtype=torch.int32"):
        state.replace(token_ids=state.token_ids.int()).validate()
