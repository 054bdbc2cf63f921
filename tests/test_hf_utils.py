"""Helpers for the transformers-integration tests: a tiny seeded Llama, a BPE-like vocabulary,
prompts with delimiters, and the obviously-correct references (stock SDPA on a DynamicCache
holding either the raw tokens or the "expanded" cache, each merged slot repeated size times).

Other test_hf_* modules import these (``from test_hf_utils import tiny_model``); the few tests
here check the helpers themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvcompress.attention import expand_state  # noqa: E402
from kvcompress.hf import CompressedCache, register_attention  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matmuls take microseconds: worker threads only add overhead (10x on a
    loaded 2-core machine). Autouse in every module that imports it; restores the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


VOCAB_SIZE = 128
# token i decodes to a word; every 8th token is a delimiter (".", ",", "\n" ...), some fused
_DELIMS = (".", ",", "\n", " ?", "!", ".\n", " ,", "\t")
TINY_VOCAB = tuple(_DELIMS[(i // 8) % len(_DELIMS)] if i % 8 == 0 else f" w{i}" for i in range(VOCAB_SIZE))
DELIMITER_IDS = tuple(i for i in range(VOCAB_SIZE) if i % 8 == 0)

# a pipeline that surely merges on a 40-60 token prompt: fixed chunks of 8, few protected slots
MERGING = dict(keep_ratio=0.5, sinks=2, recent=4, chunker={"name": "fixed", "params": {"size": 8}})
MERGE_NOTHING = dict(keep_ratio=1.0)


def tiny_config(**changes) -> LlamaConfig:
    cfg = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg.update(changes)
    return LlamaConfig(**cfg)


def tiny_model(seed: int = 0, dtype=torch.float32, attn: str = "kvcompress", **changes) -> LlamaForCausalLM:
    """The spec's tiny random Llama (2 layers, 4 query heads, 2 KV heads, head_dim 16), seeded."""
    register_attention()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**changes)).eval()
    # random init gives near-uniform logits; larger weights make greedy choices well separated
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.set_attn_implementation(attn)
    return model.to(dtype)


def stock_copy(model) -> LlamaForCausalLM:
    """The same weights on transformers' own "sdpa" attention (the reference)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    return ref


def prompt_ids(seed: int, length: int, batch: int = 1) -> torch.Tensor:
    """[batch, length] random token ids (delimiters included, as in text)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB_SIZE, (batch, length), generator=gen)


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 1-d id tensors with left padding: input_ids [B, T], attention_mask [B, T]."""
    T = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - p.numel():] = p
        mask[b, T - p.numel():] = 1
    return ids, mask


def tiny_tokenizer():
    """A word-level fast tokenizer over TINY_VOCAB-sized ids (unknown words -> [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[PAD]", ".", ",", "?", "the", "a", "is", "of", "to", "and", "in", "secret", "code",
             "word", "pineapple", "What"]
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[PAD]")


def make_cache(model, pipeline="semanticache", backend="sdpa", **overrides) -> CompressedCache:
    """A cache bound to ``model`` (SDPA backend unless asked: flex compiles take seconds on CPU)."""
    return CompressedCache.for_model(model, None, pipeline, vocab=TINY_VOCAB, backend=backend, **overrides)


def expanded_reference(cache: CompressedCache, config) -> DynamicCache:
    """A DynamicCache holding, per layer, the compressed cache's slots each repeated size times.

    Attention over it (stock SDPA) is the ground truth for proportional attention over the
    merged slots. Keys are stored rotated, so the repeated copies need no new positions.
    """
    ref = DynamicCache(config=config)
    for idx, layer in enumerate(cache.layers):
        keys, values, log_sizes = expand_state(cache.layer_state(idx))
        assert bool((log_sizes == 0).all()), "the expanded reference needs rows of equal token counts"
        ref.update(keys, values, idx)
    return ref


def raw_reference(model, ids: torch.Tensor) -> DynamicCache:
    """A stock DynamicCache after a stock prefill of ``ids``."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    return cache


# ---------------------------------------------------------------------------- tests of the helpers
def test_tiny_vocab_has_fused_delimiters():
    assert TINY_VOCAB[0] == "." and TINY_VOCAB[40] == ".\n" and TINY_VOCAB[1] == " w1"


def test_expanded_reference_of_an_uncompressed_cache_is_the_raw_cache():
    model = tiny_model()
    ids = prompt_ids(0, 12)
    cache = make_cache(model, None)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    ref = expanded_reference(cache, model.config)
    raw = raw_reference(stock_copy(model), ids)
    for a, b in zip(ref.layers, raw.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    cache.close()
