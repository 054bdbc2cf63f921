"""The FlexAttention path through the whole model: agreement with the SDPA path and the number of
compilations over a long generation. Skipped without kvcompress.flex or a C++ compiler (inductor
on CPU needs one)."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers")
flex = pytest.importorskip("kvcompress.flex")
if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
    pytest.skip("torch.compile on CPU needs a C++ compiler", allow_module_level=True)

from test_hf_utils import (  # noqa: E402
    MERGING, make_cache, prompt_ids, tiny_model,
    one_thread,  # noqa: F401  (autouse fixture)
)

from kvcompress.hf import compile_count  # noqa: E402


def _forward(model, ids, cache):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache).logits


# FlexAttention on CPU needs head dims >= 32 (kvcompress.flex): 4 heads of 32
WIDE = dict(hidden_size=128)


def test_flex_and_sdpa_paths_agree():
    model = tiny_model(seed=70, **WIDE)
    caches = {backend: make_cache(model, **MERGING, backend=backend) for backend in ("flex", "sdpa")}
    inputs = [prompt_ids(71, 48)] + [prompt_ids(72 + t, 1) for t in range(3)] + [prompt_ids(80, 5)]
    for ids in inputs:
        got = {backend: _forward(model, ids, cache) for backend, cache in caches.items()}
        torch.testing.assert_close(got["flex"], got["sdpa"], atol=1e-4, rtol=0)
    assert caches["flex"].layers[0].n < 48


def test_flex_failure_leaves_the_cache_as_it_was():
    model = tiny_model(seed=69)  # head_dim 16: FlexAttention refuses it on CPU
    cache = make_cache(model, **MERGING, backend="flex")
    with torch.no_grad():
        model(input_ids=prompt_ids(68, 40), cache=cache)  # prefill runs on stock SDPA
    before = cache.get_seq_length(), cache.slots_per_layer()
    with pytest.raises(ValueError, match="head dims"):
        _forward(model, prompt_ids(67, 1), cache)
    assert (cache.get_seq_length(), cache.slots_per_layer()) == before


def test_a_long_generation_compiles_a_handful_of_graphs():
    model = tiny_model(seed=81, **WIDE)
    cache = make_cache(model, **dict(MERGING, recompress_every=32), backend="flex")
    prompt = prompt_ids(82, 40)
    before = compile_count()
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                             max_new_tokens=300, min_new_tokens=300, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 340
    assert cache.stats["decode_compressions"] > 0  # slot counts moved up and down
    compiles = compile_count() - before
    assert compiles <= 6, f"{compiles} compilations for a 300-token generation"
