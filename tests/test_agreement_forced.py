"""Generation agreement's teacher-forced metrics: on the full cache's own answer path, the compressed
context's logits against the full cache's; checked against a token-by-token decode (the slow, obvious way)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress.eval.agreement import agreement_windows, forced_agreement, run_agreement
from kvcompress.eval.caches import Recorder, compressed_copy
from kvcompress.eval.data import Haystack
from kvcompress.eval.greedy import build_prompt, greedy, stop_ids
from kvcompress.eval.methods import Method, parse_methods
from kvcompress.eval.reconstruction import copy_for
from kvcompress.eval.results import CellStore
from kvcompress.eval.runner import Grid
from kvcompress.hf.generate import cache_kwarg

from test_eval_helpers import TEXT, model, one_thread, tiny_model, tiny_tokenizer, tok  # noqa: F401  (fixtures)

SMALL = {"recent": 8, "sinks": 2}
NEW = 6
BUDGET = 0.25


def test_forced_agreement_on_hand_made_logits():
    torch.manual_seed(0)
    ref = torch.randn(5, 11)
    same = forced_agreement(ref, ref.clone())
    assert same["forced_kl"] == pytest.approx(0.0, abs=1e-12) and same["forced_top1"] == 1.0 and same["forced_lead"] == 5
    other = ref.clone()
    other[2, ref[2].argmax()] = -100.0  # position 2's argmax moves; later positions agree again
    got = forced_agreement(ref, other)
    assert got["forced_lead"] == 2 and got["forced_top1"] == pytest.approx(4 / 5) and got["forced_kl"] > 0.0
    p = torch.log_softmax(ref.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    want = sum(float((p[i].exp() * (p[i] - q[i])).sum()) for i in range(5)) / 5
    assert got["forced_kl"] == pytest.approx(want, rel=1e-9)


def _stepwise_logits(model, cache, prompt, answer):
    """The answer path's logits decoded one token at a time (tail first), the way greedy feeds a cache."""
    key = cache_kwarg(model)
    rows = []
    with torch.inference_mode():
        out = model(input_ids=prompt.tail, use_cache=True, **{key: cache})
        rows.append(out.logits[0, -1].float())
        for t in answer:
            out = model(input_ids=torch.tensor([[t]]), use_cache=True, **{key: cache})
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@pytest.mark.parametrize("preset", ["snapkv", "kvzip-copy-heads-aligned"])
def test_forced_metrics_equal_a_token_by_token_decode(model, tok, tmp_path, preset):
    windows = agreement_windows(tok, Haystack(TEXT, "toy"), length=90, samples=1)
    grid = Grid(parse_methods(f"full,{preset}", None, SMALL), (BUDGET,))
    records = run_agreement(model, tok, windows, grid, CellStore(tmp_path, {"task": "agreement"}), new_tokens=NEW,
                            chat=False, backend="sdpa", progress=False)
    by = {r["preset"]: r for r in records}
    full = by["full"]
    assert full["forced_kl"] == pytest.approx(0.0, abs=1e-9) and full["forced_top1"] == 1.0

    # the slow reference: the same window, prefill, reference answer, then one token at a time
    (sid, text), = windows
    prompt = build_prompt(tok, text, "Summarize the text above.", False)
    cfg = Method.parse(preset).config(BUDGET).replace(**SMALL)
    rec = Recorder.for_configs(model, tok, [cfg], backend="sdpa")
    try:
        rec.feed(prompt.head)
        snap = rec.snapshot()
    finally:
        rec.close()
    ref_copy = compressed_copy(model, snap, Method.parse("full").config(1.0))
    reference, _ = greedy(model, ref_copy.cache, prompt.tail, NEW, stop_ids(tok))
    ref_copy.cache.close()
    assert full["forced_lead"] == len(reference) + 1  # every position, the one after the answer too
    ref_copy = compressed_copy(model, snap, Method.parse("full").config(1.0))
    want_ref = _stepwise_logits(model, ref_copy.cache, prompt, reference)
    ref_copy.cache.close()
    copy = copy_for(model, tok, snap, cfg)
    copy.cache.enabled = False
    got = _stepwise_logits(model, copy.cache, prompt, reference)
    copy.cache.close()
    p, q = torch.log_softmax(want_ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = [float((p[i].exp() * (p[i] - q[i])).sum()) for i in range(len(p))]
    same = [bool(want_ref[i].argmax() == got[i].argmax()) for i in range(len(p))]
    lead = next((i for i, s in enumerate(same) if not s), len(same))
    r = by[preset]
    assert r["forced_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-4, abs=1e-7)
    assert r["forced_top1"] == pytest.approx(sum(same) / len(same)) and r["forced_lead"] == lead
    assert r["forced_kl"] > 1e-6  # the compressed context really differs from the full one
    assert math.isfinite(r["forced_kl"]) and r["lead"] <= len(reference)
