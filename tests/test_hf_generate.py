"""model.generate with a CompressedCache: greedy, sampling, beams, left-padded batches, cache
reuse after a manual prefill, and the batch operations beam search relies on."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import (  # noqa: E402
    one_thread,  # noqa: F401  (autouse fixture)
    MERGE_NOTHING, MERGING, left_pad, make_cache, prompt_ids, stock_copy, tiny_model,
)


def _generate(model, ids, mask=None, cache=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    extra = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **extra, **kw)


def test_greedy_merge_nothing_equals_stock_and_merging_runs():
    model = tiny_model(seed=30)
    stock = stock_copy(model)
    ids = prompt_ids(31, 36)
    want = _generate(stock, ids, max_new_tokens=12, do_sample=False)
    got = _generate(model, ids, cache=make_cache(model, **MERGE_NOTHING), max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    cache = make_cache(model, **MERGING)
    out = _generate(model, ids, cache=cache, max_new_tokens=12, do_sample=False)
    assert out.shape == (1, 48) and torch.equal(out[:, :36], ids)
    assert cache.get_seq_length() == 47  # the last generated token is not fed
    assert out[0, 36] == want[0, 36]  # the first new token sees the full prompt (compression runs after it)


def test_sampling_merge_nothing_equals_stock_with_the_same_seed():
    model = tiny_model(seed=32)
    stock = stock_copy(model)
    ids = prompt_ids(33, 30)
    torch.manual_seed(123)
    want = _generate(stock, ids, max_new_tokens=10, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(123)
    got = _generate(model, ids, cache=make_cache(model, **MERGE_NOTHING), max_new_tokens=10, do_sample=True,
                    top_k=0, temperature=1.0)
    assert torch.equal(got, want)
    torch.manual_seed(123)
    out = _generate(model, ids, cache=make_cache(model, **MERGING), max_new_tokens=10, do_sample=True)
    assert out.shape == (1, 40)


def test_beam_search_merge_nothing_equals_stock_and_merging_runs():
    model = tiny_model(seed=34)
    stock = stock_copy(model)
    ids = prompt_ids(35, 32)
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False, num_return_sequences=2)
    want = _generate(stock, ids, **kw)
    got = _generate(model, ids, cache=make_cache(model, **MERGE_NOTHING), **kw)
    assert torch.equal(got, want)
    cache = make_cache(model, **MERGING)
    out = _generate(model, ids, cache=cache, **kw)
    assert out.shape == (2, 40)
    assert cache.layers[0]._k.shape[0] == 3  # one row per beam


def test_left_padded_batch_gives_the_tokens_of_each_prompt_alone():
    model = tiny_model(seed=36)
    a, b = prompt_ids(37, 44)[0], prompt_ids(38, 29)[0]
    ids, mask = left_pad([a, b])
    batched = _generate(model, ids, mask, cache=make_cache(model, **MERGING), max_new_tokens=8, do_sample=False)
    for row, prompt in enumerate((a, b)):
        alone = _generate(model, prompt[None], cache=make_cache(model, **MERGING), max_new_tokens=8, do_sample=False)
        assert batched[row, ids.shape[1]:].tolist() == alone[0, prompt.numel():].tolist()


def test_reorder_cache_carries_sizes_positions_and_token_ids():
    model = tiny_model(seed=39)
    ids = torch.cat([prompt_ids(40, 40), prompt_ids(41, 40)])
    cache, twin = make_cache(model, **MERGING), make_cache(model, **MERGING)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        model(input_ids=ids, cache=twin)
    before = {name: getattr(cache.layers[1], name).clone() for name in ("log_sizes", "positions", "keys")}
    token_ids = cache.token_ids.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    for name, t in before.items():
        assert torch.equal(getattr(cache.layers[1], name), t.flip(0))
    assert torch.equal(cache.token_ids, token_ids.flip(0))
    nxt = prompt_ids(42, 2).T  # [2, 1]
    with torch.no_grad():
        got = model(input_ids=nxt.flip(0), cache=cache).logits
        want = model(input_ids=nxt, cache=twin).logits
    torch.testing.assert_close(got, want.flip(0), atol=1e-5, rtol=0)


def test_batch_repeat_interleave_and_select():
    model = tiny_model(seed=43)
    cache = make_cache(model, **MERGING)
    with torch.no_grad():
        model(input_ids=torch.cat([prompt_ids(44, 40), prompt_ids(45, 40)]), cache=cache)
    ls = cache.layers[0].log_sizes.clone()
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.layers[0].log_sizes, ls.repeat_interleave(2, dim=0))
    assert cache.token_ids.shape[0] == 4
    cache.batch_select_indices(torch.tensor([2, 3]))
    assert torch.equal(cache.layers[0].log_sizes, ls[[1, 1]])


def test_generate_continues_a_cache_prefilled_with_all_but_the_last_token():
    model = tiny_model(seed=46)
    stock = stock_copy(model)
    ids = prompt_ids(47, 33)
    want = _generate(stock, ids, max_new_tokens=6, do_sample=False)
    cache = make_cache(model, **MERGE_NOTHING)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], cache=cache)
    got = _generate(model, ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert cache.stats["prefill_compressions"] == 2  # the prefill compressed, generate did not again
