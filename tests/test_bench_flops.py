"""FLOP lower bounds of the all-pairs presets (kvcompress.bench.flops): the counts by hand on a tiny
config, and the timed products' FLOPs follow from their shapes."""

from types import SimpleNamespace

import pytest

from kvcompress.bench import flops


def test_prefill_flops_count_the_linear_layers_and_causal_attention():
    cfg = SimpleNamespace(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=4)
    got = flops.prefill_flops(cfg, 10)
    q, kv, o, mlp = 8 * 8, 2 * 8 * 4, 8 * 8, 3 * 8 * 16  # q, k+v, o projections, gate/up/down
    assert got["linear"] == 2 * (q + kv + o + mlp) * 2 * 10
    assert got["attention"] == 2 * 2 * 50 * 4 * 2 * 2  # scores + weighted sum, half of 10 x 10, 2 heads, 2 layers
    assert got["total"] == got["linear"] + got["attention"]


@pytest.mark.parametrize("coarse", [False, True])
def test_d2o_product_shapes_and_flops(coarse):
    rec = flops.d2o_product(64, 0.25, heads=2, head_dim=8, layers=3, reps=1, coarse=coarse)
    assert (rec["kept"], rec["evicted"]) == (16, 48)
    assert rec["flops"] == pytest.approx(2 * 48 * 16 * 8 * 2 * 3)
    assert rec["cpu_s"] >= 0
    assert rec["dtype"] == ("bfloat16" if coarse else "float32")


def test_all_pairs_product_counts_each_pair_once():
    rec = flops.all_pairs_product(40, heads=2, head_dim=8, layers=3, block=16)
    assert rec["pairs_per_head"] == 40 * 39 / 2
    assert rec["flops"] == pytest.approx(2 * 780 * 8 * 2 * 3)
