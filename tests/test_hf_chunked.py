"""Chunked prefill with bounded memory: ``cache.prefill(ids, chunk=C)`` compresses after every
chunk, so a layer never holds more than its budget of the tokens seen + C slots, for every preset;
without compression it is exactly the one-shot prefill; cross-layer guards decide per chunk."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import (  # noqa: E402
    one_thread,  # noqa: F401  (autouse fixture)
    make_cache, prompt_ids, tiny_model, tiny_tokenizer,
)

import kvcompress as kc  # noqa: E402
from kvcompress.budget import target_slots  # noqa: E402
from kvcompress.pipeline import GUARD_MARK  # noqa: E402

T, C, KEEP = 256, 32, 0.25
SMALL = dict(keep_ratio=KEEP, sinks=2, recent=8)
PRESETS = [p for p in kc.list_presets() if p not in ("windowed-average", "full")]  # full keeps all; the plugin


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def _cache(model, preset, **kw):
    cache = make_cache(model, preset, **kw)
    if cache.scheduler.needs.model_pass:  # as for_model does once the reconstruction hook is registered
        from kvcompress.hf.reconstruct import prefill_hook

        cache.add_prefill_hook(prefill_hook(repeat_ids=torch.tensor([[5, 6, 7]])))
    return cache


def _peak_recorder(model, cache):
    """Slots in use per layer, the most seen at any layer's attention (a layer's cache right after
    its append, before it is compressed) and after the forward."""
    peak = {"n": 0, "mean": 0.0}

    def look(*_):
        layers = [cache.layers[i] for i in cache.compressed_layer_ids() if cache.layers[i].is_initialized]
        peak["n"] = max([peak["n"]] + [layer.n for layer in layers])
        peak["mean"] = max([peak["mean"]] + [float(layer.valid_slots().float().mean()) for layer in layers])

    handles = [layer.self_attn.register_forward_pre_hook(look) for layer in model.model.layers]
    handles.append(model.model.register_forward_hook(look))
    return peak, handles


def _next_logprobs(model, cache, nxt):
    with torch.inference_mode():
        mask = torch.ones(1, cache.num_tokens + nxt.shape[1], dtype=torch.long)
        return model(input_ids=nxt, attention_mask=mask, cache=cache).logits.float().log_softmax(-1)


def _kl(p, q):
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_stays_within_budget_plus_one_chunk(model, preset):
    ids, nxt = prompt_ids(5, T), prompt_ids(6, 8)
    chunked = _cache(model, preset, **SMALL)
    peak, handles = _peak_recorder(model, chunked)
    held_before = 0.0
    try:
        for a in range(0, T, C):
            peak["n"], peak["mean"] = 0, 0.0
            chunked.prefill(ids[:, a: a + C], chunk=C)
            # Ada-KV's heads hold different counts (a layer budget): their mean is what it keeps
            held = peak["mean"] if preset == "kvzip-adakv" else peak["n"]
            assert held <= held_before + C, (preset, a)  # never more than what was held + one chunk
            held_before = 0.0
            layers = chunked.compressed_layer_ids()
            assert chunked.stats["compressions"] == len(layers) * (a // C + 1), (preset, a)  # every chunk
            # a layer's share of the budget (1 unless the preset splits it over the layers)
            shares = chunked.budget_scale_per_layer()
            for i, share in zip(layers, shares):
                valid = chunked.layers[i].valid_slots()  # [B, H]
                if a + C >= 128:  # past the short-prompt floor (sinks, recent, anchors): the keep ratio
                    assert float(valid.float().mean()) <= target_slots(a + C, KEEP, None) * share + 6, (preset, a, i)
                held_before = max(held_before, float(valid.float().mean()) if preset == "kvzip-adakv"
                                  else chunked.layers[i].n)
            if a + C >= 128:  # the cache as a whole: the budget's size
                total = sum(float(chunked.layers[i].valid_slots().float().mean()) for i in layers)
                assert total <= len(layers) * (target_slots(a + C, KEEP, None) + 6), (preset, a)
        assert chunked.num_tokens == T
    finally:
        for h in handles:
            h.remove()
    one = _cache(model, preset, **SMALL)
    one.prefill(ids)
    full = make_cache(model, None)
    full.prefill(ids)
    ref = _next_logprobs(model, full, nxt)
    # close to one-shot compression: no worse than it by more than a small margin (on this random
    # model the merging presets are near-exact either way; the random-merge cam by ~0.3 nats)
    assert _kl(ref, _next_logprobs(model, chunked, nxt)) <= _kl(ref, _next_logprobs(model, one, nxt)) + 0.35
    for c in (chunked, one, full):
        c.close()


@pytest.mark.parametrize("preset", ["semanticache", "centroidkv-safe", "snapkv"])
def test_without_compression_chunks_equal_the_one_shot_prefill(model, preset):
    ids, nxt = prompt_ids(7, 100), prompt_ids(8, 6)
    caches = []
    for chunk in (None, 24, 100):
        cache = make_cache(model, preset, keep_ratio=1.0)
        cache.prefill(ids, chunk=chunk)
        caches.append(cache)
    base = _next_logprobs(model, caches[0], nxt)
    for cache in caches[1:]:
        torch.testing.assert_close(_next_logprobs(model, cache, nxt), base, rtol=0, atol=1e-5)
        for a, b in zip(caches[0].states(), cache.states()):
            assert a.num_tokens == b.num_tokens and torch.equal(a.positions, b.positions)
    for cache in caches:
        cache.close()


def test_cross_layer_guards_decide_for_every_chunk(model):
    ids = prompt_ids(9, T)
    cache = _cache(model, "semanticache-safe", keep_ratio=0.5, sinks=2, recent=8)
    cache.prefill(ids, chunk=64)
    marked = [st.positions[st.stats[GUARD_MARK] > 0] for st in cache.states()]
    late = torch.cat(marked)
    assert bool((late >= 64).any()) and bool((late < 64).any())  # sentences guarded in later chunks too
    one = _cache(model, "semanticache-safe", keep_ratio=0.5, sinks=2, recent=8)
    one.prefill(ids)
    # over all chunks the guards keep about what one decision over the prompt keeps
    count = lambda c: sum(int((st.stats[GUARD_MARK] > 0).sum()) for st in c.states())  # noqa: E731
    assert count(cache) <= 1.5 * count(one) + 16
    cache.close()
    one.close()


def test_generate_with_prefill_chunk_and_bad_values(model):
    tok = tiny_tokenizer()
    text = " ".join(f"w{i % 97}" + (" ." if i % 9 == 8 else "") for i in range(200))
    res = kc.generate(model, tok, text, preset="centroidkv", budget=0.25, max_new_tokens=4, backend="sdpa",
                      prefill_chunk=48, sinks=2, recent=8)
    assert res.report["prefill_chunk"] == 48 and res.report["keep_reached"] <= 0.25 + 16 / res.report["context_tokens"]
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="prefill_chunk"):
            kc.generate(model, tok, text, preset="centroidkv", prefill_chunk=bad)
    cache = make_cache(model, "centroidkv")
    with pytest.raises(ValueError, match="chunk"):
        cache.prefill(prompt_ids(1, 10), chunk=0)
    with pytest.raises(ValueError, match="input_ids"):
        cache.prefill(torch.zeros(10))
    assert not any(cache.layers[i].is_initialized for i in cache.compressed_layer_ids())  # left as it was
    cache.close()


def test_demo_flag_fails_before_the_model_loads(capsys, monkeypatch):
    from kvcompress import cli
    from kvcompress.hf import loading

    def no_model(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(loading, "load_model", no_model)
    assert cli.main(["demo", "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk" in capsys.readouterr().err
