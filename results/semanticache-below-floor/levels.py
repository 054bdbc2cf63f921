"""Which below-floor level SemantiCache needs on the measured texts, from the tokens alone (the
levels depend on token text, protection and budget, not on keys): the same windows as the
fidelity runs, the SmolLM2 tokenizer, sinks 4 / recent 32.

    python results/semanticache-below-floor/levels.py > results/semanticache-below-floor/levels.json
"""

import json
from collections import Counter

import torch

import kvcompress
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import fidelity_windows
from kvcompress.hf.loading import load_tokenizer
from kvcompress.hf.vocab import token_texts
from kvcompress.pipeline import chunk_floor

HAY = "/work/shared/data/paul_graham_essays"
tok = load_tokenizer(None)
vocab = token_texts(tok)
hay = Haystack.load(HAY)
out = {"tokenizer": "SmolLM2-135M-Instruct", "haystack": "paul_graham_essays", "runs": []}
for prefix, continuation, budgets in ((1000, 200, (0.25, 0.2, 0.1)), (128, 64, (0.25, 0.2))):
    windows = fidelity_windows(tok, hay, prefix=prefix, continuation=continuation, samples=6)
    for budget in budgets:
        levels, floors_paper, floors_clause = Counter(), [], []
        for _, ids in windows:
            ids = ids[:, :prefix]
            n = ids.shape[1]
            state = kvcompress.KVState.from_raw(torch.randn(1, 1, n, 8), torch.randn(1, 1, n, 8), token_ids=ids,
                                                vocab=vocab)
            pipe = kvcompress.Pipeline("semanticache", keep_ratio=budget)
            levels[pipe.chunking(state).level] += 1
            protected = pipe.protection(state)
            floors_paper.append(int(chunk_floor(state.valid, pipe.chunker(state, protected))) / n)
            floors_clause.append(int(chunk_floor(state.valid, pipe.fallback_chunker(state, protected))) / n)
        out["runs"].append({"prefix": prefix, "budget": budget, "windows": len(windows), "levels": dict(levels),
                            "paper_floor_keep": [round(f, 3) for f in floors_paper],
                            "clause_floor_keep": [round(f, 3) for f in floors_clause]})
print(json.dumps(out, indent=1))
