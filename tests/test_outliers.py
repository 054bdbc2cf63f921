"""Outlier-head calibration: per-head scores, selection, JSON round trip, and the HF helper on a tiny
random Llama built in the test."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress as kc
from kvcompress.outliers import (
    head_errors, load_outlier_heads, outlier_report, save_outlier_heads, select_outlier_heads,
    with_outlier_heads,
)


def small_pipeline():
    return kc.Pipeline("centroidkv", sinks=2, recent=4, keep_ratio=0.3, **{"chunker.size": 16})


def test_head_errors_rank_a_mergeable_head_below_a_random_head():
    gen = torch.Generator().manual_seed(0)
    B, H, T, D, W = 1, 2, 120, 8, 6
    keys = torch.randn(B, H, T, D, generator=gen)
    values = torch.randn(B, H, T, D, generator=gen)
    keys[:, 0] = keys[:, 0, :1]  # head 0: identical keys and values, merging changes nothing
    values[:, 0] = values[:, 0, :1]
    q = torch.randn(B, 4, W, D, generator=gen)
    err = head_errors(small_pipeline(), keys, values, q, W)
    assert err.shape == (2,)
    assert float(err[0]) < 1e-5 < float(err[1])


def test_head_errors_match_a_slow_reference():
    """Recompute the error head by head with explicit softmax loops over the expanded cache."""
    gen = torch.Generator().manual_seed(1)
    B, H, T, D, W = 1, 2, 60, 4, 3
    keys = torch.randn(B, H, T, D, generator=gen)
    values = torch.randn(B, H, T, D, generator=gen)
    q = torch.randn(B, 2, W, D, generator=gen)
    pipe = small_pipeline()
    err = head_errors(pipe, keys, values, q, W)
    prefix = kc.KVState.from_raw(keys[:, :, : T - W], values[:, :, : T - W])
    comp, _ = pipe.compress(prefix)
    for h in range(H):
        num = den = 0.0
        for i in range(W):
            qi = q[0, h, i].double()
            # compressed context (with log-size) plus the raw window up to and including token i
            ks = [comp.keys[0, h, n].double() for n in range(comp.num_slots) if comp.valid[0, h, n]]
            vs = [comp.values[0, h, n].double() for n in range(comp.num_slots) if comp.valid[0, h, n]]
            ls = [float(comp.log_sizes[0, h, n]) for n in range(comp.num_slots) if comp.valid[0, h, n]]
            for t in range(T - W, T - W + i + 1):
                ks.append(keys[0, h, t].double()); vs.append(values[0, h, t].double()); ls.append(0.0)
            logits = torch.stack([qi @ k / math.sqrt(D) + s for k, s in zip(ks, ls)])
            approx = (torch.softmax(logits, 0)[:, None] * torch.stack(vs)).sum(0)
            full_l = torch.stack([qi @ keys[0, h, t].double() / math.sqrt(D) for t in range(T - W + i + 1)])
            full = (torch.softmax(full_l, 0)[:, None] * values[0, h, : T - W + i + 1].double()).sum(0)
            num += float(((approx - full) ** 2).sum())
            den += float((full ** 2).sum())
        assert float(err[h]) == pytest.approx(math.sqrt(num / den), rel=1e-4)


@settings(max_examples=30, deadline=None)
@given(L=st.integers(1, 12), H=st.integers(1, 9), frac=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_select_outlier_heads_takes_the_top_fraction(L, H, frac, seed):
    scores = torch.rand(L, H, generator=torch.Generator().manual_seed(seed))
    heads = select_outlier_heads(scores, frac)
    count = min(L * H, math.ceil(frac * L * H - 1e-9))
    assert len(heads) == count == len(set(heads))
    flat = sorted(((float(scores[l, h]), (l, h)) for l in range(L) for h in range(H)), reverse=True)
    assert set(heads) == {p for _, p in flat[:count]}


def test_four_percent_of_smollm2_heads():
    assert len(select_outlier_heads(torch.rand(30, 3))) == 4  # ceil(0.04 * 90)


def test_json_round_trip_and_config(tmp_path):
    scores = torch.tensor([[0.1, 0.9], [0.3, 0.2]])
    report = outlier_report(scores, 0.25, window=8)
    path = save_outlier_heads(tmp_path / "o.json", report)
    data = json.loads(path.read_text())
    assert data["full_heads"] == [[0, 1]] and data["scores"][0][1] == pytest.approx(0.9)
    assert load_outlier_heads(path) == ((0, 1),)
    cfg = with_outlier_heads("centroidkv", path, keep_ratio=0.3)
    assert cfg.full_heads == ((0, 1),) and cfg.keep_ratio == 0.3 and cfg.name == "centroidkv"
    # the pipeline honours it: head 1 of layer 0 keeps its full cache
    state = kc.KVState.from_raw(torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8))
    out, _ = kc.Pipeline(cfg).compress(state, layer_idx=0)
    assert out.valid.sum(-1).tolist() == [[90, 300]]


@pytest.mark.parametrize("bad", [{"full_heads": [[0, -1]]}, {"full_heads": [[0]]}, {"heads": []}, [1, 2]])
def test_bad_outlier_files(tmp_path, bad):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError):
        load_outlier_heads(path)


def test_bad_arguments():
    with pytest.raises(ValueError, match="fraction"):
        select_outlier_heads(torch.rand(2, 2), 1.5)
    with pytest.raises(ValueError, match="window"):
        head_errors(small_pipeline(), torch.randn(1, 1, 10, 4), torch.randn(1, 1, 10, 4), torch.randn(1, 1, 10, 4), 10)


# ---------------------------------------------------------------- the transformers helper
@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_collect_layers_reproduces_the_models_attention(tiny_llama):
    from kvcompress.hf.calibrate import check_queries, collect_layers

    ids = torch.randint(0, 100, (1, 90), generator=torch.Generator().manual_seed(0))
    layers = collect_layers(tiny_llama, ids, window=8)
    assert len(layers) == 2
    k, v, q, out = layers[0]
    assert k.shape == (1, 2, 90, 16) and q.shape == (1, 4, 8, 16) and out.shape == (1, 4, 8, 16)
    mods = [m for m in tiny_llama.modules() if hasattr(m, "q_proj")]
    check_queries(layers, lambda i: mods[i].scaling)  # passes: recomputed queries are the model's
    wrong = [(k, v, q.flip(2), out) for k, v, q, out in layers]
    with pytest.raises(RuntimeError, match="queries"):
        check_queries(wrong, lambda i: mods[i].scaling)


def test_calibrate_outlier_heads_on_tiny_llama(tiny_llama, tmp_path):
    from kvcompress.hf.calibrate import calibrate_outlier_heads

    ids = torch.randint(0, 100, (1, 200), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "outliers.json"
    report = calibrate_outlier_heads(tiny_llama, None, input_ids=ids, config="centroidkv", window=16,
                                     path=path, keep_ratio=0.3, sinks=4, recent=8)
    scores = torch.tensor(report["scores"])
    assert scores.shape == (2, 2) and bool((scores > 0).all()) and bool(torch.isfinite(scores).all())
    assert len(report["full_heads"]) == 1  # ceil(4% of 4 heads)
    l, h = report["full_heads"][0]
    assert float(scores[l, h]) == float(scores.max())
    assert report["tokens"] == 200 and report["window"] == 16
    cfg = with_outlier_heads(report["config"], path)
    assert cfg.full_heads == ((l, h),) and cfg.keep_ratio == 0.3
