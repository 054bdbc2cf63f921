"""Architectures beyond Llama: sliding-window and hybrid models (Gemma 2, Gemma 3, Qwen2 with a
window on its upper layers), GPT-NeoX (its attention passes no kwargs to cache.update), and the
refusals: softcapping, models whose every layer slides. Tiny random models built here.

"full" must give stock transformers' tokens exactly (greedy); a compressing preset must run and
compress only the full-attention layers."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from test_hf_utils import MERGING, TINY_VOCAB, VOCAB_SIZE, one_thread, prompt_ids  # noqa: E402,F401
from kvcompress.hf import CompressedCache, CompressedLayer, register_attention, sliding_windows  # noqa: E402

WINDOW = 8  # shorter than the prompts: the sliding layers really slide
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _gemma2(**changes):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = dict(COMMON, head_dim=16, num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=16,
               layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=None,
               final_logit_softcapping=None)
    cfg.update(changes)
    return Gemma2ForCausalLM(Gemma2Config(**cfg))


def _gemma3(**changes):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = dict(COMMON, head_dim=16, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    cfg.update(changes)
    return Gemma3ForCausalLM(Gemma3TextConfig(**cfg))


def _qwen2_hybrid(**changes):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    cfg.update(changes)
    return Qwen2ForCausalLM(Qwen2Config(**cfg))


def _neox(**changes):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_hidden_layers=2, max_position_embeddings=256)
    cfg.update(changes)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**cfg))


BUILDERS = {"gemma2": _gemma2, "gemma3": _gemma3, "qwen2-hybrid": _qwen2_hybrid, "gpt-neox": _neox}


def _model(name: str, seed: int = 0):
    register_attention()
    torch.manual_seed(seed)
    model = BUILDERS[name]().eval()
    with torch.no_grad():  # well separated greedy choices
        model.get_output_embeddings().weight.mul_(8.0)
    # Gemma 2 declares no SDPA support (its softcapping): its stock reference is eager attention
    model.set_attn_implementation("eager" if name == "gemma2" else "sdpa")
    return model


def _generate(model, ids, cache=None, n=12, **kw):
    extra = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0, **extra, **kw)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_full_equals_stock_transformers_token_for_token(name):
    model = _model(name, seed=1)
    stock = copy.deepcopy(model)
    ids = prompt_ids(2, 30)
    kw = dict(output_logits=True, return_dict_in_generate=True)
    want = _generate(stock, ids, **kw)
    before = model.config._attn_implementation
    with CompressedCache.for_model(model, None, "full", vocab=TINY_VOCAB, backend="sdpa") as cache:
        got = _generate(model, ids, cache, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):  # every step, not only the argmax
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert model.config._attn_implementation == before  # left as found


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_compressing_preset_runs_and_compresses_only_full_attention_layers(name):
    model = _model(name, seed=3)
    ids = prompt_ids(4, 48)
    windows = sliding_windows(model)
    with CompressedCache.for_model(model, None, "semanticache", vocab=TINY_VOCAB, backend="sdpa",
                                   recompress_every=4, **MERGING) as cache:
        out = _generate(model, ids, cache, n=16)
        assert out.shape == (1, 64)
        assert cache.stats["prefill_compressions"] == sum(w is None for w in windows)
        assert cache.stats["decode_compressions"] > 0
        for i, (layer, w) in enumerate(zip(cache.layers, windows)):
            if w is None:
                assert isinstance(layer, CompressedLayer) and layer.n < 63
            else:  # transformers' own bounded layer, untouched by kvcompress
                assert isinstance(layer, DynamicSlidingWindowLayer) and layer.keys.shape[2] <= WINDOW
        assert cache.get_seq_length() == 63
        states = cache.states()
        assert [s is None for s in states] == [w is not None for w in windows]


def test_sliding_layers_are_exact_and_full_layers_match_a_stock_cache_when_nothing_merges():
    """With merge-nothing, every layer's keys equal a stock DynamicCache's (sliding ones slide)."""
    model = _model("gemma3", seed=5)
    stock = copy.deepcopy(model)
    ids = prompt_ids(6, 30)
    ref = DynamicCache(config=stock.config)
    with torch.no_grad():
        stock(input_ids=ids, past_key_values=ref)
        cache = CompressedCache.for_model(model, None, "full", vocab=TINY_VOCAB, backend="sdpa")
        model(input_ids=ids, past_key_values=cache)
    for i, (mine, theirs) in enumerate(zip(cache.layers, ref.layers)):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=0)
    cache.close()


def test_deepcopy_of_a_hybrid_cache_generates_like_the_original():
    model = _model("gemma2", seed=7)
    doc = prompt_ids(8, 40)
    cache = CompressedCache.for_model(model, None, "semanticache", vocab=TINY_VOCAB, backend="sdpa", **MERGING)
    with torch.no_grad():
        model.model(input_ids=doc, past_key_values=cache)
    twin = copy.deepcopy(cache)
    full = torch.cat([doc, prompt_ids(9, 3)], dim=1)
    assert torch.equal(_generate(model, full, twin, n=6), _generate(model, full, cache, n=6))


def test_softcapping_is_refused_up_front_naming_it():
    model = _gemma2(attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        CompressedCache.for_model(model, None, "semanticache")
    assert model.config._attn_implementation != "kvcompress"


def test_every_layer_sliding_is_refused_naming_the_window_and_the_fix():
    from transformers import MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW))
    with pytest.raises(ValueError, match="sliding_window=None"):
        CompressedCache.for_model(windowed, None, "semanticache")
    plain = MistralForCausalLM(MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=None))
    with CompressedCache.for_model(plain, None, "semanticache", vocab=TINY_VOCAB, backend="sdpa") as cache:
        assert cache.compressed_layer_ids() == (0, 1)


def test_gpt_neox_needs_the_bound_forward_to_find_its_requests():
    """GPT-NeoX's attention calls update without kwargs: an unbound cache cannot hand it the
    request, and says so instead of attending wrongly."""
    model = _model("gpt-neox", seed=10)
    model.set_attn_implementation("kvcompress")
    cache = CompressedCache(None, num_layers=2, backend="sdpa")
    with pytest.raises(ValueError, match="attn_implementation"):
        with torch.no_grad():
            model(input_ids=prompt_ids(11, 10), past_key_values=cache)
    assert cache.get_seq_length() == 0
