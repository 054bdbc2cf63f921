"""A synthetic KV cache with a little structure, so the examples run on CPU in seconds without a model.

Not an example itself: the examples import it (``python examples/<name>.py`` puts this folder on
sys.path). The "text" is sentences over a toy vocabulary with BPE-like decoded texts (" the",
" ,", ".\\n"); keys and values of a token are

    topic of its sentence + embedding of its token id + noise

so neighbouring tokens of one sentence have similar keys (as real keys do), sentence ends are
delimiter tokens, and a chunker that follows sentences sees coherent chunks.
"""

from __future__ import annotations

import torch

WORDS = (" the", " a", " cat", " dog", " sat", " ran", " on", " mat", " big", " red", " house", " tree",
         " over", " under", " quickly", " slowly", " and", " then", " it", " was")
DELIMITERS = (".", " ,", ".\n", "?", "!")
VOCAB = WORDS + DELIMITERS  # token id -> decoded text


def toy_text(num_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [num_tokens] and sentence index [num_tokens]: sentences of 12-36 words, a comma
    now and then, ending with a delimiter."""
    ids, sentence = [], []
    s = 0
    while len(ids) < num_tokens:
        length = int(torch.randint(12, 37, (1,), generator=generator))
        for i in range(length):
            comma = i > 2 and i < length - 2 and float(torch.rand(1, generator=generator)) < 0.04
            word = int(torch.randint(0, len(WORDS), (1,), generator=generator))
            ids.append(VOCAB.index(" ,") if comma else word)
            sentence.append(s)
        ends = [VOCAB.index(d) for d in (".", ".\n", "?", "!")]  # a sentence ends with . .\n ? or !
        ids.append(ends[int(torch.randint(0, len(ends), (1,), generator=generator))])
        sentence.append(s)
        s += 1
    return torch.tensor(ids[:num_tokens]), torch.tensor(sentence[:num_tokens])


def toy_cache(num_tokens: int = 512, heads: int = 2, head_dim: int = 32, batch: int = 1, seed: int = 0,
              topic_scale: float = 1.0, token_scale: float = 0.6, noise: float = 0.35):
    """keys, values [B, H, N, D] (float32), token_ids [B, N] and the vocabulary.

    Each batch row is its own text; heads see the same text through different random projections.
    """
    gen = torch.Generator().manual_seed(seed)
    V, D = len(VOCAB), head_dim
    keys = torch.empty(batch, heads, num_tokens, D)
    values = torch.empty(batch, heads, num_tokens, D)
    token_ids = torch.empty(batch, num_tokens, dtype=torch.long)
    for b in range(batch):
        ids, sentence = toy_text(num_tokens, gen)
        token_ids[b] = ids
        S = int(sentence.max()) + 1
        for out in (keys, values):
            topics = torch.randn(heads, S, D, generator=gen)
            embed = torch.randn(heads, V, D, generator=gen)
            out[b] = (topic_scale * topics[:, sentence] + token_scale * embed[:, ids]
                      + noise * torch.randn(heads, num_tokens, D, generator=gen))
    return keys, values, token_ids, VOCAB


def toy_queries(keys: torch.Tensor, num_queries: int, query_heads_per_kv: int = 1, seed: int = 1) -> torch.Tensor:
    """[B, H * G, W, D] queries that each look for an earlier stretch of the text: the mean key of
    a random window of 16 tokens, plus noise, scaled so attention is peaked but not one-hot."""
    gen = torch.Generator().manual_seed(seed)
    B, H, N, D = keys.shape
    G = query_heads_per_kv
    q = torch.empty(B, H * G, num_queries, D)
    for b in range(B):
        for h in range(H * G):
            for w in range(num_queries):
                start = int(torch.randint(0, max(1, N - num_queries - 16), (1,), generator=gen))
                q[b, h, w] = keys[b, h // G, start:start + 16].mean(0) * 2.0 + 0.3 * torch.randn(D, generator=gen)
    return q
