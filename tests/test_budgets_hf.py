"""Budgets through transformers: a batched ``model.generate`` whose one row is shorter than the
protected sinks + recent window runs (that row stays whole and gives the tokens it gives alone
with the full cache), with SemantiCache at a budget below its anchor floor too."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import one_thread, left_pad, make_cache, prompt_ids, tiny_model  # noqa: E402,F401

import kvcompress  # noqa: E402


def _generate(model, ids, mask, cache):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, cache=cache, max_new_tokens=6,
                              do_sample=False)


@pytest.mark.parametrize("preset,budget", [("centroidkv", 0.5), ("snapkv", 0.5), ("semanticache", 0.2)])
def test_a_batch_with_a_row_shorter_than_the_protection_generates(preset, budget):
    model = tiny_model(seed=50)
    short, long = prompt_ids(51, 5)[0], prompt_ids(52, 200)[0]  # 200 * 0.5 > 16 + 64 protected
    ids, mask = left_pad([short, long])
    cache = make_cache(model, preset, keep_ratio=budget, on_infeasible="error")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvcompress.BudgetWarning)  # semanticache 0.2: "met below the floor"
        out = _generate(model, ids, mask, cache)
    slots = [layer.valid_slots() for layer in cache.layers]  # [B, H] each
    assert all(int(s[0].min()) >= 5 for s in slots)  # the short row: nothing merged or dropped
    assert all(int(s[1].max()) <= int(206 * budget) + 6 for s in slots)  # the long row: compressed
    alone = _generate(model, short[None], torch.ones(1, 5, dtype=torch.long), make_cache(model, None))
    assert out[0, ids.shape[1]:].tolist() == alone[0, 5:].tolist()
    cache.close()
