"""The data contract between the core and its users: one budget rule, declared strategy needs,
declared decode hooks (no name tables), and counts/stats/extras on KVState."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress import KVState, Pipeline, PipelineConfig
from kvcompress.budget import target_slots
from kvcompress.decode import DecodeCompressor, append_tokens
from kvcompress.protocols import ClusterPlan, Needs, needs_of
from kvcompress.registry import CLUSTERERS, GUARDS


# ---------------------------------------------------------------------------- budget
@CORE_SETTINGS
@given(tokens=st.lists(st.integers(0, 5000), min_size=1, max_size=4),
       ratio=st.floats(1e-4, 1.0, allow_nan=False))
def test_budget_rule_matches_plain_arithmetic_for_ints_and_tensors(tokens, ratio):
    expected = [max(1, math.floor(t * ratio + 1e-9)) for t in tokens]
    assert [target_slots(t, ratio, None) for t in tokens] == expected
    got = target_slots(torch.tensor(tokens), ratio, None)
    assert got.dtype == torch.long and got.tolist() == expected
    assert target_slots(tokens[0], None, 7) == 7
    assert target_slots(torch.tensor(tokens), None, 7).tolist() == [7] * len(tokens)


def test_budget_rule_rejects_both_or_neither_budget():
    with pytest.raises(ValueError, match="keep_ratio/max_slots"):
        target_slots(10, 0.5, 3)
    with pytest.raises(ValueError, match="keep_ratio/max_slots"):
        target_slots(10, None, None)


def test_pipeline_and_decode_use_the_one_rule_with_its_floor_of_one():
    """3 tokens at keep_ratio 0.1: 0.3 slots, the rule says 1 everywhere (no 0-slot budget)."""
    state = KVState.from_raw(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    pipe = Pipeline(PipelineConfig(keep_ratio=0.1, sinks=0, recompress_every=1))
    assert pipe.target_slots(state).tolist() == [[1, 1]]
    dec = DecodeCompressor(pipe)
    # 3 slots > budget 1 + g 1: compress; 2 slots do not exceed it
    assert dec.should_compress(state)
    two = KVState.from_raw(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert not dec.should_compress(two)


# ---------------------------------------------------------------------------- needs
def test_needs_union_and_model_pass_implies_all_layers():
    a = Needs(query_window=4, attention=True)
    b = Needs(query_window=2, reference_queries=8, model_pass=True)
    u = a | b
    assert u == Needs(query_window=4, reference_queries=8, attention=True, all_layers=True, model_pass=True)
    assert Needs(model_pass=True).all_layers
    assert Needs.union([]) == Needs()
    with pytest.raises(ValueError, match="query_window"):
        Needs(query_window=-1)


def test_an_aligned_pass_implies_the_pass_and_one_asking_is_enough():
    assert Needs(pass_aligned=True).model_pass and Needs(pass_aligned=True).all_layers
    assert not Needs().pass_aligned and not Needs().model_pass
    assert (Needs(pass_aligned=True) | Needs(pass_lead=8)).pass_aligned
    assert not (Needs(model_pass=True) | Needs(pass_lead=8)).pass_aligned
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="pass_aligned"):
            Needs(pass_aligned=bad)


def test_a_pass_lead_implies_the_pass_and_the_longer_lead_wins():
    assert Needs(pass_lead=8).model_pass and Needs(pass_lead=8).all_layers
    assert not Needs(pass_lead=0).model_pass
    assert (Needs(pass_lead=8) | Needs(pass_lead=32, attention=True)).pass_lead == 32
    assert (Needs(model_pass=True) | Needs()).pass_lead == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="pass_lead"):
            Needs(pass_lead=bad)


@dataclass(frozen=True)
class _NeedyGuard:
    """Protects nothing; declares that it needs reference queries and the attention received."""

    needs = Needs(reference_queries=5, attention=True)

    def __call__(self, state: KVState) -> torch.Tensor:
        return torch.zeros_like(state.valid)


def _plain_function_guard(state):
    return torch.zeros_like(state.valid)


@pytest.fixture
def needy_guard():
    GUARDS.register("test-needy")(_NeedyGuard)
    GUARDS.register("test-plain")(lambda: _plain_function_guard)
    yield
    GUARDS.unregister("test-needy")
    GUARDS.unregister("test-plain")


def test_pipeline_needs_aggregate_config_fields_guards_and_declared_hooks(needy_guard):
    assert Pipeline("semanticache").needs == Needs()
    cfg = PipelineConfig(query_window=3, guards=[{"name": "test-needy"}, {"name": "test-plain"}])
    needs = Pipeline(cfg).needs
    assert needs == Needs(query_window=3, reference_queries=5, attention=True)
    assert needs_of(_plain_function_guard) == Needs()
    # a cross-layer guard (declares prepare/prepared_for) makes the prefill compression wait
    safe = Pipeline("semanticache-safe")
    assert safe.needs.all_layers and safe.needs_all_layers
    assert Pipeline("snapkv").needs.query_window > 0
    assert Pipeline("h2o").needs.attention


def test_a_needs_attribute_of_the_wrong_type_is_refused():
    class Bad:
        needs = {"query_window": 3}

    with pytest.raises(ValueError, match="Needs"):
        needs_of(Bad())


# ---------------------------------------------------------------------------- decode hooks
@dataclass(frozen=True)
class _TailClusterer:
    """Merges nothing; declares the "tail" decode scope through the hook, not by name."""

    decode_scope = "tail"

    def __call__(self, state, chunk_ids, target, round_idx=0):
        return ClusterPlan(torch.arange(state.num_slots).expand_as(state.positions).clone(), done=True)


def test_decode_scope_comes_from_the_declared_hook_for_any_name():
    CLUSTERERS.register("test-tail-anything")(_TailClusterer)
    try:
        pipe = Pipeline(PipelineConfig(clusterer="test-tail-anything", on_infeasible="best_effort"))
        assert DecodeCompressor(pipe).scope == "tail"
        assert DecodeCompressor(Pipeline("centroidkv")).scope == "all"
        assert DecodeCompressor(Pipeline("semanticache")).scope == "tail"
        assert DecodeCompressor(Pipeline("snapkv")).scope == "all"
    finally:
        CLUSTERERS.unregister("test-tail-anything")


# ---------------------------------------------------------------------------- counts / stats / extras
def test_append_pads_stats_with_zeros_counts_with_ones_and_carries_extras():
    state = KVState.from_raw(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    queries = torch.randn(1, 2, 3, 4)  # shaped like a per-slot tensor: still carried as is
    state = state.replace(counts=torch.full((1, 2, 3), 2.0), stats={"attn_acc": torch.ones(1, 2, 3)},
                          extras={"queries": queries})
    grown = append_tokens(state, torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert grown.stats["attn_acc"].tolist() == [[[1.0, 1.0, 1.0, 0.0, 0.0]] * 2]
    assert grown.counts.tolist() == [[[2.0, 2.0, 2.0, 1.0, 1.0]] * 2]
    assert grown.extras["queries"] is queries
    grown.validate()


def test_token_counts_is_zero_on_padding_and_exp_of_the_bias_without_counts():
    state = KVState.from_raw(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2),
                             attention_mask=torch.tensor([[0, 1, 1, 1]]))
    assert state.token_counts().tolist() == [[[0.0, 1.0, 1.0, 1.0]]]
    explicit = state.replace(counts=torch.tensor([[[9.0, 3.0, 1.0, 1.0]]]))
    assert explicit.token_counts().tolist() == [[[0.0, 3.0, 1.0, 1.0]]]
