"""The scratch pool: one buffer per name reused, per thread, per inference mode, bounded."""

from __future__ import annotations

import threading

import pytest
import torch

from kvcompress.strategies import scratch as sc


def test_same_name_reuses_the_storage_and_grows(monkeypatch):
    monkeypatch.setattr(sc, "POOL_MIN", 0)
    sc.clear()
    a = sc.scratch("t.a", (4, 8), torch.float32, "cpu")
    b = sc.scratch("t.a", (2, 8), torch.float32, "cpu")
    assert a.data_ptr() == b.data_ptr() and tuple(b.shape) == (2, 8) and b.is_contiguous()
    c = sc.scratch("t.a", (16, 8), torch.float32, "cpu")  # larger: a new buffer, then reused
    assert tuple(c.shape) == (16, 8) and sc.scratch("t.a", (3, 3), torch.float32, "cpu").data_ptr() == c.data_ptr()
    assert sc.scratch("t.b", (4, 8), torch.float32, "cpu").data_ptr() != c.data_ptr()
    assert sc.scratch("t.a", (4, 8), torch.int64, "cpu").data_ptr() != c.data_ptr()  # per dtype
    sc.clear()
    assert sc.pooled_bytes() == 0


def test_inference_mode_has_its_own_buffers(monkeypatch):
    monkeypatch.setattr(sc, "POOL_MIN", 0)
    sc.clear()
    with torch.inference_mode():
        inside = sc.scratch("t.c", (8,), torch.float32, "cpu")
        assert inside.is_inference()
    outside = sc.scratch("t.c", (8,), torch.float32, "cpu")
    assert not outside.is_inference()
    outside.fill_(1.0)  # writable outside inference mode
    sc.clear()


def test_threads_do_not_share(monkeypatch):
    monkeypatch.setattr(sc, "POOL_MIN", 0)
    sc.clear()
    mine = sc.scratch("t.d", (8,), torch.float32, "cpu").data_ptr()
    seen = []
    t = threading.Thread(target=lambda: seen.append(sc.scratch("t.d", (8,), torch.float32, "cpu").data_ptr()))
    t.start(), t.join()
    assert seen[0] != mine
    sc.clear()


def test_bounded(monkeypatch):
    monkeypatch.setattr(sc, "POOL_MIN", 0)
    sc.clear()
    monkeypatch.setattr(sc, "POOL_TOTAL", 1000)
    a = sc.scratch("t.e", (100,), torch.float32, "cpu")  # 400 bytes: pooled
    b = sc.scratch("t.f", (200,), torch.float32, "cpu")  # would hold 1200: fresh
    assert sc.pooled_bytes() == 400 and sc.scratch("t.f", (200,), torch.float32, "cpu").data_ptr() != b.data_ptr()
    monkeypatch.setattr(sc, "POOL_LIMIT", 100)
    assert sc.scratch("t.e", (50,), torch.float32, "cpu").data_ptr() != a.data_ptr()  # over the per-buffer limit
    sc.clear()


def test_small_and_non_cpu_requests_are_not_pooled():
    sc.clear()
    a = sc.scratch("t.g", (4,), torch.float32, "cpu")  # under POOL_MIN
    assert sc.pooled_bytes() == 0 and tuple(a.shape) == (4,)
    big = sc.scratch("t.g", (sc.POOL_MIN // 4,), torch.float32, torch.device("cpu"))
    assert sc.pooled_bytes() == sc.POOL_MIN and big.numel() == sc.POOL_MIN // 4
    sc.clear()



@pytest.mark.parametrize("preset", ["semanticache", "semanticache-safe"])  # per layer; at the forward's end
def test_a_compressed_cache_holds_no_scratch_after_its_rounds(monkeypatch, preset):
    """The scheduler hands the pool back when a round ends: the prefill's, decode re-compressions',
    and ``compress()``'s; the rounds did use it (what was held when it was handed back)."""
    from test_hf_utils import MERGING, make_cache, prompt_ids, tiny_model

    monkeypatch.setattr(sc, "POOL_MIN", 0)
    sc.clear()
    held, clear = [], sc.clear
    monkeypatch.setattr(sc, "clear", lambda: (held.append(sc.pooled_bytes()), clear()))
    model = tiny_model(seed=41)
    cache = make_cache(model, pipeline=preset, **{**MERGING, "recompress_every": 2})
    ids = prompt_ids(42, 40)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=8, pad_token_id=0,
                       do_sample=False)
    assert sc.pooled_bytes() == 0
    assert max(held) > 0
    after_generate = len(held)
    cache.compress()
    assert sc.pooled_bytes() == 0 and len(held) > after_generate


def test_a_round_hands_the_pool_back_even_when_it_raises(monkeypatch):
    monkeypatch.setattr(sc, "POOL_MIN", 0)
    sc.clear()
    with pytest.raises(RuntimeError):
        with sc.compression_round():
            sc.scratch("t.g", (64,), torch.float32, "cpu")
            assert sc.pooled_bytes() == 256
            raise RuntimeError("a layer failed")
    assert sc.pooled_bytes() == 0
