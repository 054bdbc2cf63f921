"""Evaluation suite on a tiny random Llama: prefill reuse, copies, resumability, outputs, CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvcompress.eval.caches import Recorder, compressed_copy, trace_mark
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import compare, fidelity_windows, run_fidelity
from kvcompress.eval.greedy import build_prompt, greedy
from kvcompress.eval.methods import Method, parse_methods
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.results import CellStore
from kvcompress.eval.runner import Grid, run_qa
from kvcompress.types import KVState

from test_eval_helpers import TEXT, stub_eval_cli, ForwardCounter, model, one_thread, tiny_model, tiny_tokenizer, tok  # noqa: F401,E501  (fixtures)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = {"recent": 8}  # so that the presets can compress a ~150-token prompt



@pytest.fixture(scope="module")
def samples(tok):
    return niah_samples(tok, Haystack(TEXT, "toy"), [120], [0.2, 0.8], samples=1, kind="number", seed=0)


# ------------------------------------------------------------------------------ copies
@pytest.mark.parametrize("preset", ["semanticache", "centroidkv", "snapkv", "h2o"])
def test_copy_equals_compressing_in_the_prefill(model, tok, samples, preset):
    """A copy compressed from the recorded prefill holds exactly what the cache holds when the
    pipeline runs inside a real prefill, and decodes the same tokens."""
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg

    prompt = build_prompt(tok, samples[0].context, samples[0].question)
    cfg = Method.parse(preset).config(0.4).replace(recent=8)
    direct = CompressedCache.for_model(model, tok, cfg, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=prompt.head, use_cache=True, **{cache_kwarg(model.base_model): direct})
    rec = Recorder(model, tok, query_window=cfg.query_window, track_attention=cfg.track_attention, backend="sdpa")
    rec.feed(prompt.head)
    copy = compressed_copy(model, rec.snapshot(), cfg)
    rec.close()
    for a, b in zip(direct.layers, copy.cache.layers):
        assert a.n == b.n and a.num_tokens == b.num_tokens
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
        assert torch.equal(a.log_sizes, b.log_sizes) and torch.equal(a.positions, b.positions)
    assert copy.keep_max <= 0.4 + 1e-9 and copy.layers_met
    out_a, _ = greedy(model, direct, prompt.tail, 6)
    out_b, _ = greedy(model, copy.cache, prompt.tail, 6)
    assert out_a == out_b
    direct.close()
    copy.cache.close()


def test_keep_exactly_at_the_budget_counts_as_met(model, tok, samples):
    """8 slots of 40 tokens is keep 0.2 exactly: float32 reads 8 / 40 as 0.2000000030, above the
    budget, and the records said budget_met=False at every multiple of 5 tokens."""
    prompt = build_prompt(tok, samples[0].context, samples[0].question)
    rec = Recorder(model, tok, backend="sdpa")
    rec.feed(prompt.head[:, :40])
    cfg = Method.parse("streamingllm").config(0.2).replace(sinks=0, recent=0)
    copy = compressed_copy(model, rec.snapshot(), cfg)
    rec.close()
    assert copy.layers_met and copy.keep_max == 0.2 and copy.keep_max <= 0.2 + 1e-9
    copy.cache.close()


def test_copies_leave_the_snapshot_untouched(model, tok, samples):
    prompt = build_prompt(tok, samples[0].context, samples[0].question)
    rec = Recorder(model, tok, backend="sdpa")
    rec.feed(prompt.head)
    snap = rec.snapshot()
    rec.feed(prompt.tail)  # later appends to the recorder cannot reach the snapshot
    rec.close()
    before = [(s.keys.clone(), s.values.clone()) for s in snap.states]
    for budget in (0.5, 0.3):
        c = compressed_copy(model, snap, Method.parse("semanticache").config(budget).replace(recent=8))
        greedy(model, c.cache, prompt.tail, 3)
        c.cache.close()
    for s, (k, v) in zip(snap.states, before):
        assert torch.equal(s.keys, k) and torch.equal(s.values, v) and s.num_tokens == prompt.head.shape[1]


def test_oracle_protection_keeps_the_needle_whole(model, tok, samples):
    s = samples[0]
    prompt = build_prompt(tok, s.context, s.question)
    from kvcompress.eval.data import token_span

    span = token_span(prompt.offsets, s.spans["needle"], shift=prompt.context_offset)
    rec = Recorder(model, tok, backend="sdpa")
    rec.feed(prompt.head)
    snap = rec.snapshot()
    rec.close()
    for preset in ("centroidkv", "streamingllm", "semanticache-fixed64"):
        cfg = Method.parse(preset).config(0.3).replace(recent=8, sinks=2)
        plain = compressed_copy(model, snap, cfg, marks={"needle": span})
        guarded = compressed_copy(model, snap, cfg, protect=[span], marks={"needle": span})
        assert guarded.trace["needle"]["alone"] == pytest.approx(1.0)
        assert guarded.trace["needle"]["kept"] == pytest.approx(1.0)
        assert plain.trace["needle"]["alone"] < 1.0  # without the oracle the needle is touched
        for layer in guarded.cache.layers:
            pos = layer.positions[0]  # [H, N]
            single = layer.log_sizes[0] == 0
            for tpos in range(*span):  # every needle token is a slot of its own in every head
                assert bool(((pos == tpos) & single).any(-1).all())
        plain.cache.close()
        guarded.cache.close()


def test_trace_mark_against_a_hand_count():
    # one head, 4 slots: sizes 1, 3, 2, padding; marked tokens per slot 1, 2, 0, 0
    log_sizes = torch.tensor([[[1.0, 3.0, 2.0, 1.0]]]).log()
    log_sizes[..., 3] = float("-inf")
    state = KVState(keys=torch.randn(1, 1, 4, 2), values=torch.randn(1, 1, 4, 2), log_sizes=log_sizes,
                    positions=torch.tensor([[[0, 1, 4, -1]]]), num_tokens=6)
    t = trace_mark(state, torch.tensor([[[1.0, 2.0, 0.0, 5.0]]]), length=4)
    # 3 of 4 marked tokens kept (one evicted), 1 alone, 2 mixed into a slot of 3 tokens
    assert t == {"kept": 0.75, "alone": 0.25, "mixed": 0.5, "slots": 2.0, "size": 2.0}


# ------------------------------------------------------------------------------ the grid
def test_grid_prefills_once_per_sample_resumes_and_writes_outputs(model, tok, samples, tmp_path):
    from kvcompress.cli_eval import finish

    methods = parse_methods("full,semanticache,snapkv", None, SMALL)
    grid = Grid(methods, (0.5, 0.25), ("agnostic", "aware"))
    with ForwardCounter(model) as counter:
        store = CellStore(tmp_path, {"task": "niah"})
        records = run_qa(model, tok, samples, grid, store, backend="sdpa", progress=False, max_new_tokens=3)
    n_cells = 2 * (1 + 2 * 2)
    assert len(records) == len(samples) * n_cells
    heads = [build_prompt(tok, s.context, s.question).head.shape[1] for s in samples]
    # the model saw each context once: one head-length forward per sample, whatever the methods
    assert sorted(n for n in counter.lengths if n >= min(heads)) == sorted(heads)
    assert all(r["prefill_forwards"] == 2 for r in records)  # head, then the question for "aware"

    for r in records:
        for field in ("method", "budget", "protocol", "length", "depth", "needle", "answer", "hit", "score",
                      "leading_digits", "keep_max", "keep_mean", "budget_met", "trace", "compress_s"):
            assert field in r, field
        assert r["budget_met"] == (r["keep_max"] <= r["budget"] + 1e-9)
    for s, head in zip(samples, heads):
        tail = build_prompt(tok, s.context, s.question).tail.shape[1]
        for r in records:
            if r["sample_id"] == s.sample_id:  # aware compresses the question too, all but the last token
                assert r["compressed_tokens"] == head + (0 if r["protocol"] == "agnostic" else tail - 1)
                assert r["context_tokens"] < head
    # delimiter anchors floor SemantiCache above keep 0.25 on this text: its fallback chunker
    # (mergeable delimiters) reaches it, and the records say the keep reached
    sc = [r for r in records if r["preset"] == "semanticache" and r["budget"] == 0.25]
    assert sc and all(r["budget_met"] and r["keep_max"] <= 0.25 for r in sc)

    # a rerun computes nothing and returns the same records
    with ForwardCounter(model) as counter:
        again = run_qa(model, tok, samples, grid, CellStore(tmp_path, {"task": "niah"}), backend="sdpa",
                       progress=False, max_new_tokens=3)
    assert counter.lengths == [] and again == records
    # a sample whose prompt changed under the same id (a generator change) runs again
    changed = [dataclasses.replace(samples[0], context=samples[0].context.replace("cat", "dog"))] + samples[1:]
    with ForwardCounter(model) as counter:
        redone = run_qa(model, tok, changed, grid, CellStore(tmp_path, {"task": "niah"}), backend="sdpa",
                        progress=False, max_new_tokens=3)
    assert sum(n >= min(heads) for n in counter.lengths) == 1
    assert redone[n_cells:] == records[n_cells:] and redone[0]["prompt_sha"] != records[0]["prompt_sha"]
    samples = changed
    # a bigger grid runs only the new cells
    bigger = Grid(methods, (0.5, 0.25, 0.75), ("agnostic", "aware"))
    with ForwardCounter(model) as counter:
        more = run_qa(model, tok, samples, bigger, CellStore(tmp_path, {"task": "niah"}), backend="sdpa",
                      progress=False, max_new_tokens=3)
    assert len(more) == len(samples) * 2 * (1 + 2 * 3)
    assert len((tmp_path / "cells.jsonl").read_text().splitlines()) == len(more) + n_cells  # + the redone ones

    agnostic = [r for r in more if r["protocol"] == "agnostic"]  # fewer panels: faster plots
    summary = finish(tmp_path, "niah", {"task": "niah"}, agnostic)
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data) >= {"meta", "machine", "aggregate", "samples", "by_length", "by_cell"}
    assert len(data["samples"]) == len(agnostic)
    row = next(r for r in data["aggregate"] if r["method"] == "full")
    assert row["n"] == len(samples) and row["budget"] == 1.0
    for name in ("heatmap_agnostic.png", "summary.png", "accuracy_vs_budget.png", "leading_digits_vs_budget.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    assert "| method |" in summary


# ------------------------------------------------------------------------------ fidelity
def test_compare_against_a_slow_reference():
    gen = torch.Generator().manual_seed(0)
    ref, cmp = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    targets = torch.randint(0, 7, (5,), generator=gen)
    out = compare(ref, cmp, targets)
    kls, agree, nll_r, nll_c = [], 0, 0.0, 0.0
    for i in range(5):
        p = torch.softmax(ref[i].double(), 0)
        q = torch.softmax(cmp[i].double(), 0)
        kls.append(sum(float(p[j] * (p[j].log() - q[j].log())) for j in range(7)))
        agree += int(ref[i].argmax() == cmp[i].argmax())
        nll_r -= float(p[targets[i]].log()) / 5
        nll_c -= float(q[targets[i]].log()) / 5
    assert out["kl"] == pytest.approx(sum(kls) / 5) and out["top1"] == pytest.approx(agree / 5)
    assert out["ppl_full"] == pytest.approx(torch.tensor(nll_r).exp().item())
    assert out["ppl"] == pytest.approx(torch.tensor(nll_c).exp().item())


@pytest.mark.parametrize("chunk", [None, 7])
def test_fidelity_full_cache_is_exact_and_compression_is_not(model, tok, tmp_path, chunk):
    windows = fidelity_windows(tok, Haystack(TEXT, "toy"), prefix=80, continuation=20, samples=1)
    assert windows[0][1].shape == (1, 101)
    grid = Grid(parse_methods("full,streamingllm,semanticache-fixed64", None, SMALL), (0.5,))
    records = run_fidelity(model, tok, windows, grid, CellStore(tmp_path, {"task": "fidelity"}), prefix=80,
                           chunk=chunk, backend="sdpa", progress=False)
    full = next(r for r in records if r["method"] == "full")
    assert full["kl"] < 1e-6 and full["top1"] == 1.0 and full["ppl"] == pytest.approx(full["ppl_full"], rel=1e-5)
    assert full["positions"] == 20
    for r in records:
        if r["method"] != "full":
            assert r["kl"] > 1e-9 and r["top1"] <= 1.0 and r["keep_max"] <= 0.5 + 1e-9


# ------------------------------------------------------------------------------ CLI
def test_cli_niah_end_to_end_and_report(model, tok, tmp_path, monkeypatch):
    from kvcompress import cli_eval

    hay = stub_eval_cli(monkeypatch, model, tok, tmp_path)
    out = tmp_path / "out"
    argv = ["niah", "--haystack", str(hay), "--lengths", "100", "--depths", "0.5", "--presets", "full,streamingllm",
            "--method", "centroidkv:recent=8", "--override", "sinks=2", "--budgets", "0.5", "--protocols",
            "agnostic,aware", "--max-new-tokens", "2", "--no-progress", "--no-plots", "--out", str(out)]
    assert cli_eval.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in data["aggregate"]} == {"full", "streamingllm:sinks=2", "centroidkv:recent=8,sinks=2"}
    assert len(data["samples"]) == 2 * 3
    assert not list(out.glob("*.png"))
    def no_model(args):
        raise AssertionError("a finished grid must not load the model")

    monkeypatch.setattr(cli_eval, "_load", no_model)
    assert cli_eval.main(argv) == 0  # resumed: nothing to do, no model loaded
    assert len((out / "cells.jsonl").read_text().splitlines()) == 6
    # another needle kind in the same directory is refused
    assert cli_eval.main(argv + ["--needle", "word"]) == 2
    (out / "results.json").unlink()
    assert cli_eval.main(["report", "--out", str(out), "--no-plots"]) == 0
    assert len(json.loads((out / "results.json").read_text())["samples"]) == 6
