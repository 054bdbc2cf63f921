"""The sentence guard inside the transformers cache: one decision for every layer, made after
the prefill from all layers, kept through decode-time compressions."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import one_thread, make_cache, prompt_ids, tiny_model  # noqa: E402,F401

from kvcompress.pipeline import GUARD_MARK  # noqa: E402

GUARD = {"name": "sentences", "params": {"signals": ["query"], "share": 0.4, "skip_layers": 0}}
SAFE = dict(keep_ratio=0.5, sinks=2, recent=4, chunker={"name": "fixed", "params": {"size": 8}},
            guards=[GUARD], query_window=4, recompress_every=4)


def _guarded_positions(layer) -> list[set]:
    st = layer.state()
    mark = st.stats[GUARD_MARK] > 0  # [B, H, N]
    return [set(st.positions[0, h][mark[0, h]].tolist()) for h in range(st.num_heads)]


def test_every_layer_and_head_protects_the_same_tokens_and_budget_is_met():
    model = tiny_model(seed=2, num_hidden_layers=3)
    cache = make_cache(model, **SAFE)
    ids = prompt_ids(3, 80)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    chosen = cache.pipeline.guards[0].chosen_tokens()[0].nonzero().squeeze(1).tolist()
    assert chosen, "the guard chose no sentence"
    assert len(chosen) <= int(0.4 * 40)
    for layer in cache.layers:
        assert all(p == set(chosen) for p in _guarded_positions(layer))
        st = layer.state()
        sizes = st.log_sizes.exp()
        mark = st.stats[GUARD_MARK] > 0
        assert bool((sizes[mark] == 1).all())  # guarded slots hold one token each
        assert bool((layer.valid_slots() <= 40).all())
    assert cache.stats["prefill_compressions"] == 3


def test_guarded_tokens_survive_decode_time_compression():
    model = tiny_model(seed=4)
    cache = make_cache(model, **SAFE)
    prompt = prompt_ids(5, 60)
    with torch.no_grad():
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                       max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert cache.stats["decode_compressions"] > 0
    chosen = set(cache.pipeline.guards[0].chosen_tokens()[0].nonzero().squeeze(1).tolist())
    for layer in cache.layers:
        assert all(p == chosen for p in _guarded_positions(layer))
