"""The reconstruction pass through the public cache API and the evaluation (tiny random Llama)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcompress.hf.reconstruct import reconstruction_scores, repeat_prompt_ids

from test_eval_helpers import TEXT, stub_eval_cli, model, one_thread, tiny_model, tiny_tokenizer, tok  # noqa: F401  (fixtures)

transformers = pytest.importorskip("transformers")



def _ids(tok, n=90):
    return torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"][:n]])


def test_for_model_runs_the_pass_and_kvzip_keeps_the_top_scored_slots(model, tok):
    """A kvzip cache bound to the model runs the pass at the prefill's end: each head keeps the
    sinks plus the best-scored slots by a pass computed apart (over a plain uncompressed prefill)."""
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg

    ids = _ids(tok)
    T = ids.shape[1]
    plain = CompressedCache.for_model(model, tok, None, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): plain})
    states = plain.states()
    plain.close()
    ref = reconstruction_scores(model, states, ids, repeat_ids=repeat_prompt_ids(tok)).scores

    cache = CompressedCache.for_model(model, tok, "kvzip", backend="sdpa", keep_ratio=0.25)
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): cache})
    assert cache.stats["reconstruct_s"] > 0
    budget = int(T * 0.25)
    sinks = cache.config.sinks
    for i, st in enumerate(cache.states()):
        for h in range(st.num_heads):
            kept = set(st.positions[0, h][st.valid[0, h]].tolist())
            assert len(kept) == budget
            best = ref[i][0, h, sinks:].topk(budget - sinks).indices + sinks
            assert kept == set(range(sinks)) | set(best.tolist()), (i, h)
    assert model.config._attn_implementation == "kvcompress"  # the pass restored it
    cache.close()


def test_kvzip_presets_through_generate(model, tok):
    import kvcompress

    for preset in ("kvzip", "kvzip-csm", "kvzip-adakv", "kvzip-d2o", "kvzip-d2o-tokens"):
        res = kvcompress.generate(model, tok, TEXT, preset, budget=0.25, max_new_tokens=3, question="What is",
                                  backend="sdpa", recent=8)
        assert res.report["budget_met"], (preset, res.report.get("budget_note"))
        assert len(res.token_ids) >= 1


def test_for_model_without_tokenizer_is_a_clear_error(model, tok):
    """No tokenizer, no repeat prompt: no pass is registered, and the prefill's compression says
    where the scores come from (the forward is undone)."""
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg

    cache = CompressedCache.for_model(model, None, "kvzip", vocab=["x"] * model.config.vocab_size, backend="sdpa")
    assert not cache.prefill_hooks
    with pytest.raises(ValueError, match="tokenizer"), torch.inference_mode():
        model.base_model(input_ids=_ids(tok, 40), use_cache=True, **{cache_kwarg(model.base_model): cache})
    cache.close()
    assert model.config._attn_implementation == "kvcompress"


def test_states_without_model_access_are_a_clear_error(model, tok):
    """A kvzip pipeline on states alone (no model pass): the scorer says where its scores come from,
    and the cache is left as it was."""
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg

    ids = _ids(tok, 40)
    plain = CompressedCache.for_model(model, tok, None, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): plain})
    states = plain.states()
    plain.close()
    cache = CompressedCache.from_states(states, "kvzip", keep_ratio=0.5)
    with pytest.raises(ValueError, match="reconstruction"):
        cache.compress()
    assert all(st.num_slots >= 40 and bool(st.valid.all()) for st in cache.states())


def test_eval_niah_runs_the_pass_once_per_sample(model, tok, tmp_path, monkeypatch):
    from kvcompress import cli_eval

    hay = stub_eval_cli(monkeypatch, model, tok, tmp_path)
    out = tmp_path / "out"
    argv = ["niah", "--haystack", str(hay), "--lengths", "120", "--depths", "0.5", "--presets",
            "full,snapkv,kvzip,kvzip-csm,kvzip-adakv", "--override", "recent=8", "--budgets", "0.25,0.5",
            "--max-new-tokens", "2", "--no-progress", "--no-plots", "--out", str(out)]
    assert cli_eval.main(argv) == 0
    rows = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    passes = [r for r in rows if r["reconstruct_s"] > 0]
    assert len({r["sample_id"] for r in rows}) == 1 and len(passes) == 1  # one pass serves every kvzip cell
    assert passes[0]["method"].startswith("kvzip")
    for r in rows:
        assert r["budget_met"], r["method"]
        if not r["method"].startswith("kvzip"):
            assert r["reconstruct_s"] == 0


def test_eval_agreement_runs(model, tok, tmp_path, monkeypatch):
    from kvcompress import cli_eval

    hay = stub_eval_cli(monkeypatch, model, tok, tmp_path, TEXT * 3)
    out = tmp_path / "agree"
    argv = ["agreement", "--haystack", str(hay), "--length", "120", "--samples", "1", "--new-tokens", "4",
            "--presets", "snapkv,kvzip", "--override", "recent=8", "--budgets", "0.5", "--no-progress",
            "--no-plots", "--out", str(out)]
    assert cli_eval.main(argv) == 0
    rows = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} >= {"snapkv:recent=8", "kvzip:recent=8"}
    for r in rows:
        assert 0.0 <= r["lcs"] <= 1.0 and r["budget_met"]


def test_eval_pass_uses_the_live_caches_repeat_prompt_on_plain_text(model, tok):
    """The fidelity protocol prefills plain text (no chat template); its reconstruction pass must
    still score with the repeat prompt a live cache uses (``prefill_hook(tokenizer)``: the chat
    template's), so the two give the same scores; the plain prompt gives other scores."""
    from kvcompress.eval.caches import Recorder
    from kvcompress.eval.methods import Method
    from kvcompress.eval.reconstruction import attach_reconstruction
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg
    from kvcompress.hf.reconstruct import STATS_KEY, prefill_hook

    assert tok.chat_template
    ids = _ids(tok, 70)
    cfg = Method.parse("kvzip").config(0.25)
    rec = Recorder.for_configs(model, tok, [cfg], backend="sdpa")
    try:
        rec.feed(ids)
        snap = rec.snapshot()
    finally:
        rec.close()
    assert attach_reconstruction(model, tok, snap) > 0
    evaluated = [st.stats[STATS_KEY] for st in snap.states]

    live = CompressedCache.for_model(model, tok, None, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): live})
    prefill_hook(tok)(live, model)  # what for_model registers for a pipeline that needs the pass
    hooked = [st.stats[STATS_KEY] for st in live.states()]
    states = live.states()
    live.close()
    plain = reconstruction_scores(model, states, ids, repeat_ids=repeat_prompt_ids(tok, chat=False)).scores
    for e, h, p in zip(evaluated, hooked, plain):
        torch.testing.assert_close(e, h, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(e, p, rtol=1e-3, atol=1e-5)


def test_live_cache_and_eval_give_the_same_prefill_surprisal(model, tok):
    """A cache for a pipeline declaring Needs(surprisal=True) gets each context token's prefill
    surprisal from its prefill hook (extras["surprisal"], every layer), equal to the eval's
    (attach_reconstruction) and to a plain forward's logits; a pipeline without the need gets none."""
    import kvcompress
    from kvcompress.eval.caches import Recorder
    from kvcompress.eval.methods import Method
    from kvcompress.eval.reconstruction import attach_reconstruction
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg
    from kvcompress.hf.reconstruct import SURPRISAL_KEY, prefill_hook

    ids = _ids(tok, 70)
    with torch.no_grad():
        logp = model(input_ids=ids).logits.float().log_softmax(-1)
    ref = torch.zeros(ids.shape)
    ref[:, 1:] = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]

    live = CompressedCache.for_model(model, tok, "kvzip-hybrid", backend="sdpa", keep_ratio=0.5, recent=8)
    seen = {}
    live.add_prefill_hook(lambda cache, m: seen.update(sur=[st.extras.get(SURPRISAL_KEY) for st in cache.states()]))
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): live})
    assert live.stats["surprisal_s"] > 0
    live.close()
    assert all(s is seen["sur"][0] for s in seen["sur"])
    torch.testing.assert_close(seen["sur"][0], ref, atol=1e-4, rtol=1e-4)

    rec = Recorder.for_configs(model, tok, [Method.parse("kvzip-hybrid").config(0.25)], backend="sdpa")
    try:
        rec.feed(ids)
        snap = rec.snapshot()
    finally:
        rec.close()
    attach_reconstruction(model, tok, snap, surprisal=True)
    torch.testing.assert_close(snap.states[0].extras[SURPRISAL_KEY], ref, atol=1e-4, rtol=1e-4)

    plain = CompressedCache.for_model(model, tok, None, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): plain})
    prefill_hook(tok)(plain, model)  # the pipeline (none) does not ask for surprisal
    assert SURPRISAL_KEY not in plain.states()[0].extras
    plain.close()

    for preset in ("kvzip-hybrid", "kvzip-sentences-surprisal"):
        res = kvcompress.generate(model, tok, TEXT, preset, budget=0.25, max_new_tokens=3, question="What is",
                                  backend="sdpa", recent=8)
        assert res.report["budget_met"], (preset, res.report.get("budget_note"))


def test_a_pipelines_pass_parameters_reach_the_live_pass_and_the_eval(model, tok):
    """A pipeline asking for a lead-in (``Needs.pass_lead``, guard ``lead``) or for the chunks at their
    full-repeat positions (``Needs.pass_aligned``, guard ``aligned``) gets them from the live cache's
    prefill hook and from the eval's pass, equal to ``reconstruction_scores(lead=L, aligned=A)``; the
    eval keeps one pass per parameters, so a method without them still reads the plain pass."""
    from kvcompress.eval.caches import Recorder
    from kvcompress.eval.methods import Method
    from kvcompress.eval.reconstruction import copy_for
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg
    from kvcompress.hf.reconstruct import DEFAULT_CHUNK, STATS_KEY

    ids = torch.tensor([(tok(TEXT, add_special_tokens=False)["input_ids"] * 8)[: DEFAULT_CHUNK + 100]])
    plain = CompressedCache.for_model(model, tok, None, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): plain})
    states = plain.states()
    plain.close()
    passes = {"kvzip": (0, False), "kvzip-copy-heads-lead": (32, False), "kvzip-copy-heads-aligned": (32, True)}
    refs = {p: reconstruction_scores(model, states, ids, repeat_ids=repeat_prompt_ids(tok), lead=lead,
                                     aligned=aligned).scores for p, (lead, aligned) in passes.items()}
    # each parameter moves the scores (~1-2 % on this tiny model): far outside the tolerance used below
    assert not torch.allclose(refs["kvzip"][0], refs["kvzip-copy-heads-lead"][0], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(refs["kvzip-copy-heads-lead"][0], refs["kvzip-copy-heads-aligned"][0], rtol=1e-4, atol=1e-6)

    for preset in ("kvzip-copy-heads-lead", "kvzip-copy-heads-aligned"):
        seen = {}
        live = CompressedCache.for_model(model, tok, preset, backend="sdpa", keep_ratio=0.5, recent=8)
        live.add_prefill_hook(lambda cache, m: seen.update(s=[st.stats[STATS_KEY].clone() for st in cache.states()]))
        with torch.inference_mode():
            model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): live})
        live.close()
        for got, want in zip(seen["s"], refs[preset]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    cfgs = {p: Method.parse(p).config(0.5) for p in passes}
    rec = Recorder.for_configs(model, tok, list(cfgs.values()), backend="sdpa")
    try:
        rec.feed(ids)
        snap = rec.snapshot()
    finally:
        rec.close()
    for ran in (True, False):
        for preset, cfg in cfgs.items():
            copy = copy_for(model, tok, snap, cfg)
            assert (copy.reconstruct_s > 0) == ran, preset
            for st, want in zip(snap.states, refs[preset]):
                torch.testing.assert_close(st.stats[STATS_KEY], want, rtol=1e-4, atol=1e-6)
            copy.cache.close()
    assert sorted(key[2:] for key in snap.passes) == sorted(passes.values())
