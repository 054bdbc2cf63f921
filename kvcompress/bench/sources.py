"""The benchmark's models and contexts: SmolLM2-135M, a synthetic stack of Llama-3-8B-shaped
layers with random weights, a tiny random Llama for smoke tests, and real text as token ids.

Only this module (with ``caches``) touches transformers; everything is built locally, nothing
is downloaded.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..validation import check_choice, require

SMOLLM2 = "smollm2"
LLAMA3_SYNTHETIC = "llama3-synthetic"
SMOLLM2_SYNTHETIC = "smollm2-synthetic"
TINY = "tiny"
MODELS = (SMOLLM2, LLAMA3_SYNTHETIC, SMOLLM2_SYNTHETIC, TINY)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Llama-3-8B's attention and MLP geometry (the vocabulary is the tokenizer's, see synthetic_llama)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5)
# SmolLM2-135M's geometry: timings need the shapes, not the weights (the GGUF is 94 MB and does not
# travel to every benchmark machine)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=8192, tie_word_embeddings=True)

# decoded token texts of the tiny model: words and the delimiters the delimiter chunker cuts at
TINY_VOCAB = tuple(f" w{i}" for i in range(56)) + (".", ",", "\n", "?", "!", ";", ":", ".\n")


@dataclass
class LoadedModel:
    """A model ready for the benchmark.

    name:      one of MODELS
    model:     a transformers causal LM in eval mode, attention "kvcompress"
    tokenizer: its tokenizer, or None (then ``vocab`` gives token texts and ids are synthetic)
    vocab:     decoded text of every token id (text-aware chunkers need it)
    prefill:   True when contexts are prefilled by the model; False: random keys/values
    load_s:    seconds to load or build
    """

    name: str
    model: object
    tokenizer: object
    vocab: tuple | None
    prefill: bool
    load_s: float
    description: str


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an input embedding
    that is not tied to the output head (a step reads one row of it, not the matrix)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (head is None or head.weight is not emb.weight):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def load(name: str, *, dtype: str = "float32", synthetic_layers: int = 2, tokenizer=None,
         seed: int = 0) -> LoadedModel:
    """Load or build model ``name`` (see MODELS). ``tokenizer`` (SmolLM2's) is reused by the
    synthetic model for real token ids; without one it tries to load SmolLM2's tokenizer."""
    check_choice("model", name, MODELS)
    check_choice("dtype", dtype, tuple(DTYPES))
    from ..hf import register_attention
    from ..hf.vocab import token_texts

    register_attention()
    start = time.perf_counter()
    if name == SMOLLM2:
        from ..hf.loading import load_model

        model, tok = load_model(dtype=dtype)
        return LoadedModel(name, model, tok, token_texts(tok), True, time.perf_counter() - start,
                           "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised), 30 layers, 9 query / 3 KV heads, "
                           "head dim 64")
    if name == LLAMA3_SYNTHETIC:
        tok = tokenizer if tokenizer is not None else _smollm2_tokenizer()
        vocab = token_texts(tok) if tok is not None else TINY_VOCAB
        model = synthetic_llama(synthetic_layers, len(vocab), DTYPES[dtype], seed)
        return LoadedModel(name, model, tok, vocab, False, time.perf_counter() - start,
                           f"{synthetic_layers} Llama-3-8B-shaped layers (hidden 4096, MLP 14336, 32 query / 8 KV "
                           f"heads, head dim 128), random weights, vocabulary {len(vocab)} (tied head), {dtype}")
    if name == SMOLLM2_SYNTHETIC:
        tok = tokenizer if tokenizer is not None else _smollm2_tokenizer()
        vocab = token_texts(tok) if tok is not None else TINY_VOCAB
        model = _llama(dict(SMOLLM2_135M, vocab_size=len(vocab)), DTYPES[dtype], seed)
        return LoadedModel(name, model, tok, vocab, False, time.perf_counter() - start,
                           f"SmolLM2-135M's geometry (30 layers, hidden 576, 9 query / 3 KV heads, head dim 64) "
                           f"with random weights, vocabulary {len(vocab)} (tied head), {dtype}")
    model = tiny_llama(len(TINY_VOCAB), DTYPES[dtype], seed)
    return LoadedModel(name, model, None, TINY_VOCAB, True, time.perf_counter() - start,
                       "tiny random Llama (2 layers, hidden 64, 4 query / 2 KV heads, head dim 32) for smoke tests")


def _smollm2_tokenizer():
    try:
        from transformers import AutoTokenizer

        from ..hf.loading import SMOLLM2_GGUF, smollm2_dir

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    except Exception:  # noqa: BLE001 - any failure: fall back to the synthetic vocabulary
        return None


def _llama(config_kwargs: dict, dtype: torch.dtype, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..hf.support import ATTN_AUTO

    torch.manual_seed(seed)
    cfg = LlamaConfig(**config_kwargs)
    cfg._attn_implementation = ATTN_AUTO
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).eval()
    model.set_attn_implementation(ATTN_AUTO)
    return model


def synthetic_llama(layers: int, vocab_size: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """LlamaForCausalLM with ``layers`` Llama-3-8B-shaped decoder layers and random weights.

    Memory: about 0.87 GB per layer in float32 plus vocab_size x 4096 for the tied head.
    """
    require(isinstance(layers, int) and 1 <= layers <= 8, "synthetic_layers", layers, "an integer in [1, 8]")
    return _llama(dict(LLAMA3_8B, num_hidden_layers=layers, vocab_size=vocab_size,
                       max_position_embeddings=131072, tie_word_embeddings=True), dtype, seed)


def tiny_llama(vocab_size: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A 2-layer random Llama, hidden 64, 4 query / 2 KV heads, head dim 32 (FlexAttention on CPU
    needs head dims >= 32)."""
    return _llama(dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=65536,
                       tie_word_embeddings=True), dtype, seed)


# ---------------------------------------------------------------------------- contexts
def default_text_dir() -> Path | None:
    path = Path("/work/shared/data/paul_graham_essays")
    return path if path.is_dir() else None


def read_text(source: str | Path | None = None) -> str:
    """Text from a directory of .txt files (licence files skipped), a file, or by default the Paul
    Graham essays when present, else Python's pydoc_data.topics (always installed)."""
    path = Path(source) if source is not None else default_text_dir()
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    require(path.exists(), "text", str(path), "an existing directory of .txt files or a text file")
    if path.is_dir():
        files = [f for f in sorted(glob.glob(str(path / "*.txt"))) if "license" not in Path(f).name.lower()]
        require(bool(files), "text", str(path), "a directory holding .txt files")
        return "\n\n".join(Path(f).read_text(errors="replace") for f in files)
    return path.read_text(errors="replace")


class TokenSource:
    """Token ids [1, T] of real text (repeated when too short), or, without a tokenizer, random
    ids over ``vocab`` with a delimiter about every 12 tokens."""

    def __init__(self, tokenizer, vocab, text: str | Path | None = None, seed: int = 0):
        self.tokenizer, self.vocab, self.text, self.seed = tokenizer, vocab, text, seed
        self._ids: torch.Tensor | None = None

    def ids(self, length: int) -> torch.Tensor:
        """[1, length] long."""
        require(isinstance(length, int) and length >= 2, "length", length, "an integer >= 2")
        if self.tokenizer is None:
            gen = torch.Generator().manual_seed(self.seed + length)
            ids = torch.randint(0, len(self.vocab) - 8, (1, length), generator=gen)
            delim = torch.rand(1, length, generator=gen) < 1 / 12
            return torch.where(delim, len(self.vocab) - 8 + ids % 8, ids)
        if self._ids is None or self._ids.shape[1] < length:
            ids = self.tokenizer(read_text(self.text), return_tensors="pt", add_special_tokens=False)["input_ids"]
            reps = -(-length // ids.shape[1])
            self._ids = ids.repeat(1, reps) if reps > 1 else ids
        return self._ids[:, :length].clone()
