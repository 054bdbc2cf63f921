"""CompressedCache through a whole (tiny) transformers model: exactness against stock SDPA and
against the expanded-cache reference, positions, causality of follow-ups, decode-time
compression, padding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import (  # noqa: E402
    one_thread,  # noqa: F401  (autouse fixture)
    MERGE_NOTHING, MERGING, expanded_reference, make_cache, prompt_ids, stock_copy, tiny_model,
)

from kvcompress.hf import CompressedCache  # noqa: E402


def _step(model, ids, cache, **kw):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, **kw).logits


def test_get_seq_length_counts_tokens_and_mask_sizes_are_in_slot_space():
    model = tiny_model()
    cache = make_cache(model, **MERGING)
    _step(model, prompt_ids(1, 48), cache)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 48
    assert layer.n < 48  # merged
    assert layer.get_mask_sizes(3) == (layer.n + 3, 48 - layer.n)
    assert cache.is_compileable is False and cache.is_croppable is False


@pytest.mark.parametrize("preset", ["semanticache", "semanticache-fixed64"])
def test_merge_nothing_equals_stock_sdpa(preset):
    """keep_ratio=1.0 merges nothing: prefill, single-token steps and a multi-token follow-up
    all give the logits of stock SDPA on a DynamicCache."""
    model = tiny_model(seed=1)
    stock = stock_copy(model)
    ids = prompt_ids(2, 40)
    cache = make_cache(model, preset, **MERGE_NOTHING)
    from transformers import DynamicCache

    ref = DynamicCache(config=stock.config)
    got, want = _step(model, ids, cache), _step(stock, ids, ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cache.layers[0].compressed  # the proportional path serves what follows
    for t in range(5):
        nxt = prompt_ids(10 + t, 1)
        torch.testing.assert_close(_step(model, nxt, cache), _step(stock, nxt, ref), atol=1e-5, rtol=0)
    follow = prompt_ids(20, 6)
    torch.testing.assert_close(_step(model, follow, cache), _step(stock, follow, ref), atol=1e-5, rtol=0)
    assert cache.get_seq_length() == ref.get_seq_length() == 51


def test_merged_cache_equals_expanded_reference_through_the_model():
    model = tiny_model(seed=3)
    stock = stock_copy(model)
    cache = make_cache(model, **MERGING)
    _step(model, prompt_ids(4, 56), cache)
    sizes = cache.layers[1].log_sizes.exp()
    assert float(sizes.max()) > 1.5  # really merged
    ref = expanded_reference(cache, model.config)
    for t in range(4):  # single tokens, then a 5-token follow-up
        nxt = prompt_ids(30 + t, 1)
        torch.testing.assert_close(_step(model, nxt, cache), _step(stock, nxt, ref), atol=1e-4, rtol=0)
    follow = prompt_ids(40, 5)
    torch.testing.assert_close(_step(model, follow, cache), _step(stock, follow, ref), atol=1e-4, rtol=0)


def test_positions_after_compression_are_real_token_positions():
    """The next token is rotated at position T (tokens seen), not at the slot count."""
    model = tiny_model(seed=5)
    stock = stock_copy(model)
    cache = make_cache(model, **MERGING)
    T = 50
    _step(model, prompt_ids(6, T), cache)
    slots = cache.layers[0].n
    assert slots < T and cache.get_seq_length() == T
    nxt = prompt_ids(7, 1)
    ref, ref_control = expanded_reference(cache, model.config), expanded_reference(cache, model.config)
    got = _step(model, nxt, cache)
    want = _step(stock, nxt, ref, position_ids=torch.tensor([[T]]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # control: at the slot count's position the logits differ, so this test can fail
    wrong = _step(stock, nxt, ref_control, position_ids=torch.tensor([[slots]]))
    assert (wrong - want).abs().max() > 1e-3


def test_multi_token_follow_up_is_causal():
    model = tiny_model(seed=8)
    cache_a = make_cache(model, **MERGING)
    cache_b = make_cache(model, **MERGING)
    ids = prompt_ids(9, 48)
    _step(model, ids, cache_a)
    _step(model, ids, cache_b)
    follow = prompt_ids(11, 6)
    changed = follow.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 128
    a, b = _step(model, follow, cache_a), _step(model, changed, cache_b)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], atol=1e-6, rtol=0)  # earlier tokens cannot see the last
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-4


def test_layers_may_hold_different_slot_counts():
    model = tiny_model(seed=12)
    stock = stock_copy(model)
    # layer 1 keeps every head full: its slot count differs from layer 0's
    cache = make_cache(model, **MERGING, full_heads=[[1, 0], [1, 1]])
    _step(model, prompt_ids(13, 48), cache)
    assert cache.layers[0].n < cache.layers[1].n == 48
    ref = expanded_reference(cache, model.config)
    follow = prompt_ids(14, 4)
    torch.testing.assert_close(_step(model, follow, cache), _step(stock, follow, ref), atol=1e-4, rtol=0)


def test_decode_time_compression_keeps_the_budget_and_stays_exact():
    model = tiny_model(seed=15)
    stock = stock_copy(model)
    cfg = dict(MERGING, recompress_every=4)
    cache = make_cache(model, **cfg)
    prompt = prompt_ids(16, 40)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                             max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert cache.stats["decode_compressions"] > 0
    T = cache.get_seq_length()
    assert T == out.shape[1] - 1
    for layer in cache.layers:
        budget = cache.decoder.budget(cache.layer_state(layer.layer_idx), layer.layer_idx)
        assert bool((layer.valid_slots() <= budget + 4).all())
    ref = expanded_reference(cache, model.config)
    nxt = out[:, -1:]
    torch.testing.assert_close(_step(model, nxt, cache), _step(stock, nxt, ref), atol=1e-4, rtol=0)


def test_decode_steps_do_not_reallocate_the_cache_each_step():
    model = tiny_model(seed=17)
    cache = make_cache(model, None)
    _step(model, prompt_ids(18, 20), cache)
    buffer = cache.layers[0]._k
    for t in range(10):
        _step(model, prompt_ids(19 + t, 1), cache)
    assert cache.layers[0]._k is buffer  # written in place: no O(N) copy per step


def test_left_padding_is_never_attended_even_after_merging():
    model = tiny_model(seed=20)
    ids = prompt_ids(21, 40)
    lone = make_cache(model, **MERGING)
    want = _step(model, ids, lone)
    padded_ids = torch.cat([torch.zeros(1, 9, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones(1, 40, dtype=torch.long)], dim=1)
    padded = make_cache(model, **MERGING)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate computes them
    got = _step(model, padded_ids, padded, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(got[:, 9:], want, atol=1e-4, rtol=0)
    for layer in padded.layers:
        pos = layer.positions
        assert bool((layer.log_sizes[pos < 9] == float("-inf")).all())  # padding never gets weight
    assert padded.layers[0].valid_slots().tolist() == lone.layers[0].valid_slots().tolist()
    nxt = prompt_ids(22, 1)
    mask2 = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
    torch.testing.assert_close(_step(model, nxt, padded, attention_mask=mask2, position_ids=torch.tensor([[40]])),
                               _step(model, nxt, lone),
                               atol=1e-4, rtol=0)


def test_cache_reports_bytes_and_slots():
    model = tiny_model(seed=23)
    cache = make_cache(model, **MERGING)
    _step(model, prompt_ids(24, 48), cache)
    rep = cache.report()
    # 2 layers x 2 KV heads x 48 tokens x 16 dims x (keys + values) x 4 bytes
    assert rep["kv_bytes_full"] == 2 * 2 * 48 * 16 * 2 * 4
    assert rep["kv_bytes_compressed"] < rep["kv_bytes_full"]
    assert rep["slots_per_layer"] == [layer.n for layer in cache.layers]
    assert rep["compressions"] == 2


def test_unbound_cache_with_set_inputs():
    """A cache not bound to a model works when the caller declares the inputs (or without ids)."""
    model = tiny_model(seed=25)
    stock = stock_copy(model)
    cache = CompressedCache(None, num_layers=2, backend="sdpa")
    ids = prompt_ids(26, 20)
    from transformers import DynamicCache

    ref = DynamicCache(config=stock.config)
    cache.set_inputs(ids)
    torch.testing.assert_close(_step(model, ids, cache), _step(stock, ids, ref), atol=1e-5, rtol=0)
    assert cache.token_ids.tolist() == ids.tolist()
    nxt = prompt_ids(27, 1)  # no set_inputs: ids unknown (-1), still exact
    torch.testing.assert_close(_step(model, nxt, cache), _step(stock, nxt, ref), atol=1e-5, rtol=0)
    assert cache.token_ids[0, -1].item() == -1


def test_proportional_attention_off_ignores_sizes_but_still_masks_padding():
    model = tiny_model(seed=28)
    ids = prompt_ids(29, 40)
    padded_ids = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 40, dtype=torch.long)], dim=1)
    off, on = make_cache(model, **MERGING, proportional_attention=False), make_cache(model, **MERGING)
    for cache in (off, on):
        _step(model, padded_ids, cache, attention_mask=mask)
    # the same slots with every valid log-size set to 0 (weight 1 each), padding kept at -inf
    for layer in on.layers:
        ls = layer._ls[:, :, : layer.n]
        ls.copy_(torch.where(torch.isinf(ls), ls, torch.zeros_like(ls)))
    nxt = prompt_ids(30, 1)
    mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
    got = _step(model, nxt, off, attention_mask=mask)
    torch.testing.assert_close(got, _step(model, nxt, on, attention_mask=mask), atol=1e-6, rtol=0)
    with_sizes = make_cache(model, **MERGING)
    _step(model, padded_ids, with_sizes, attention_mask=mask[:, :-1])
    assert (got - _step(model, nxt, with_sizes, attention_mask=mask)).abs().max() > 1e-4


def test_hooks_are_removed_with_the_cache():
    import gc

    model = tiny_model(seed=31)
    cache = make_cache(model, **MERGING)
    base = model.model
    assert len(base._forward_pre_hooks) == 1 and len(base._forward_hooks) == 1
    del cache
    gc.collect()
    assert len(base._forward_pre_hooks) == 0 and len(base._forward_hooks) == 0
    with make_cache(model, **MERGING) as cache:  # or explicitly, keeping the contents
        _step(model, prompt_ids(32, 20), cache)
    assert len(base._forward_pre_hooks) == 0 and cache.get_seq_length() == 20


def test_token_texts_are_built_once_per_tokenizer_and_feed_the_delimiter_chunker():
    from test_hf_utils import tiny_tokenizer

    from kvcompress.hf import token_texts

    tok = tiny_tokenizer()
    table = token_texts(tok)
    assert token_texts(tok) is table and len(table) == len(tok)
    assert table[tok.convert_tokens_to_ids(".")] == "."
    model = tiny_model(seed=33)
    cache = CompressedCache.for_model(model, tok, "semanticache", keep_ratio=0.5, recent=4, backend="sdpa")
    ids = tok("the secret code word is pineapple . " * 8, return_tensors="pt")["input_ids"]
    _step(model, ids, cache)
    dot = tok.convert_tokens_to_ids(".")
    kept = cache.layer_state(0).slot_token_ids()
    assert int((kept == dot).sum()) == 2 * 8  # every delimiter survives as an anchor, in both heads
    assert cache.layers[0].n < ids.shape[1]
