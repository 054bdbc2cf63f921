"""kvcompress.generate, the one-call helper, on the tiny model with a word-level tokenizer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import (  # noqa: E402
    stock_copy, tiny_model, tiny_tokenizer,
    one_thread,  # noqa: F401  (autouse fixture)
)

import kvcompress  # noqa: E402
from kvcompress import PipelineConfig  # noqa: E402
from kvcompress.api import budget_overrides  # noqa: E402

CONTEXT = " ".join(["the secret code word is pineapple ." if i % 7 == 3 else f"w{i % 90} w{(i * 7) % 90} , w{i % 50} ."
                    for i in range(30)])
QUESTION = "What is the secret code word ?"
SMALL = dict(recent=4, sinks=2, chunker="fixed", backend="sdpa")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=90), tiny_tokenizer()


def test_generate_returns_text_and_report(tiny):
    model, tok = tiny
    result = kvcompress.generate(model, tok, CONTEXT, "semanticache", 0.5, max_new_tokens=5, question=QUESTION,
                                 **SMALL)
    rep = result.report
    assert isinstance(result.text, str) and len(result.token_ids) == 5
    text, info = result  # the README's spelling
    assert text == result.text and info is rep
    for key in ("answer", "kv_bytes_full", "kv_bytes_compressed", "slots_per_layer", "prefill_s", "compress_s",
                "decode_s", "context_tokens", "question_tokens"):
        assert key in rep
    assert rep["kv_bytes_compressed"] < 0.6 * rep["kv_bytes_full"]
    assert rep["question_tokens"] == len(tok(f"\n\n{QUESTION}\n", add_special_tokens=False)["input_ids"])


def test_merge_nothing_gives_the_stock_answer(tiny):
    model, tok = tiny
    result = kvcompress.generate(model, tok, CONTEXT, "semanticache", 1.0, max_new_tokens=6, question=QUESTION,
                                 **SMALL)
    head = tok(CONTEXT, return_tensors="pt")["input_ids"]
    tail = tok(f"\n\n{QUESTION}\n", return_tensors="pt", add_special_tokens=False)["input_ids"]
    ids = torch.cat([head, tail], dim=1)
    with torch.no_grad():
        want = stock_copy(model).generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                          do_sample=False, pad_token_id=tok.pad_token_id)
    assert result.token_ids == want[0, ids.shape[1]:].tolist()


def test_presets_as_name_dict_or_config_and_budgets(tiny):
    model, tok = tiny
    cfg = kvcompress.get_preset("semanticache").replace(recent=4, sinks=2, chunker="fixed")
    as_dict = cfg.to_dict()
    for preset in (cfg, as_dict):
        rep = kvcompress.generate(model, tok, CONTEXT, preset, 0.5, max_new_tokens=2, backend="sdpa").report
        assert rep["kv_bytes_compressed"] < rep["kv_bytes_full"]
    rep = kvcompress.generate(model, tok, CONTEXT, cfg, 40, max_new_tokens=2, backend="sdpa").report
    assert max(rep["valid_slots_per_layer"]) <= 40
    full = kvcompress.generate(model, tok, CONTEXT, None, None, max_new_tokens=2, backend="sdpa").report
    assert full["kv_bytes_compressed"] >= full["kv_bytes_full"]  # nothing dropped (log-sizes on top)


def test_beams_through_the_helper(tiny):
    model, tok = tiny
    result = kvcompress.generate(model, tok, CONTEXT, "semanticache", 0.5, max_new_tokens=4, question=QUESTION,
                                 num_beams=2, **SMALL)
    assert len(result.token_ids) == 4


def test_budget_validation():
    assert budget_overrides(0.25) == {"keep_ratio": 0.25, "max_slots": None}
    assert budget_overrides(128) == {"max_slots": 128, "keep_ratio": None}
    assert budget_overrides(None) == {}
    for bad in (0.0, 1.5, -3, "half", True):
        with pytest.raises(ValueError, match="budget"):
            budget_overrides(bad)
    assert isinstance(kvcompress.get_preset("semanticache"), PipelineConfig)


def test_the_prefill_time_leaves_out_the_scorers_passes(tiny, monkeypatch):
    """kvzip-hybrid runs a reconstruction and a surprisal pass after the prefill: each is reported
    on its own, not inside prefill_s (a pass made 0.4 s slower moves reconstruct_s alone)."""
    import dataclasses
    import time

    from kvcompress.hf import reconstruct

    model, tok = tiny
    plain = kvcompress.generate(model, tok, CONTEXT, "semanticache", 0.5, max_new_tokens=2, **SMALL).report
    assert plain["reconstruct_s"] == 0.0 and plain["surprisal_s"] == 0.0
    real = reconstruct.reconstruction_scores

    def slower(*args, **kwargs):
        res = real(*args, **kwargs)
        time.sleep(0.4)
        return dataclasses.replace(res, seconds=res.seconds + 0.4)

    monkeypatch.setattr(reconstruct, "reconstruction_scores", slower)
    rep = kvcompress.generate(model, tok, CONTEXT, "kvzip-hybrid", 0.5, max_new_tokens=2, backend="sdpa").report
    assert rep["reconstruct_s"] >= 0.4 and rep["surprisal_s"] > 0.0
    assert 0.0 <= rep["prefill_s"] < 0.4
