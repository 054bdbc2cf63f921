"""The efficiency benchmark's machinery on a tiny random Llama (seconds; no timing asserts):
byte accounting against hand-computed sizes, floors against hand-made runs, cache clones,
peak-RSS measurement, the command line and the plots."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvcompress.bench import BenchSettings, run_bench  # noqa: E402
from kvcompress.bench import caches as C  # noqa: E402
from kvcompress.bench.floors import evaluate  # noqa: E402
from kvcompress.bench.memory import PeakRSS  # noqa: E402
from kvcompress.bench.sources import TINY_VOCAB, TokenSource, load, tiny_llama, weight_bytes_per_token  # noqa: E402
from kvcompress.bench.timing import summarize  # noqa: E402
from kvcompress.hf.generate import cache_kwarg  # noqa: E402

TINY = dict(models=("tiny",), lengths=(64,), budgets=(0.5,), presets=("streamingllm",), backends=("sdpa",),
            decode_tokens=2, warmup=1, attention_reps=1, profile=False, progress=False, bandwidth_bytes=1 << 22)


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "eff.json"
    results = run_bench(BenchSettings(**TINY), out=out, log=lambda line: None)
    return results, out


def test_results_file_holds_every_run_and_the_machine(tiny_results):
    results, out = tiny_results
    on_disk = json.loads(out.read_text())
    assert on_disk["complete"] is True
    assert [(r["method"], r["backend"]) for r in on_disk["runs"]] == [
        ("full-stock", "stock-sdpa"), ("full", "sdpa"), ("streamingllm", "sdpa")]
    for r in on_disk["runs"]:
        assert len(r["tpot"]["steps_ms"]) == 2 and r["tpot"]["median_ms"] > 0
        assert r["attention"]["reps"] == 1
    machine = on_disk["machine"]
    assert machine["cores"] >= 1 and machine["torch"] == torch.__version__ and "load_average" in machine
    assert [f["name"] for f in on_disk["floors"]] == [
        "kv_bytes", "attention_32k", "tpot_smollm2_8k", "compression_overhead_8k", "bandwidth_smollm2_8k"]


def test_a_preset_needing_the_reconstruction_pass_runs_it_and_reports_it_apart(tmp_path):
    """kvzip presets read the reconstruction statistic: the bench runs the pass (the cache's
    prefill hook, as CompressedCache.for_model registers it) and reports its time beside the
    compression, which does not include it."""
    settings = BenchSettings(**{**TINY, "presets": ("kvzip", "streamingllm"), "stock": False})
    results = run_bench(settings, out=tmp_path / "eff.json", log=lambda line: None)
    runs = {r["method"]: r for r in results["runs"]}
    assert runs["kvzip"]["reconstruct_s"] > 0 and runs["kvzip"]["compress_s"] > 0
    assert runs["kvzip"]["budget_met"] and runs["kvzip"]["keep_max"] <= 0.5 + 1e-9
    assert runs["streamingllm"]["reconstruct_s"] is None and runs["full"]["reconstruct_s"] is None
    assert len(runs["kvzip"]["tpot"]["steps_ms"]) == 2


def test_the_reconstruction_pass_writes_the_statistic_the_pipeline_reads():
    from kvcompress.bench.caches import compressed_cache, prefill_snapshot
    from kvcompress.presets import get_preset

    loaded = load("tiny")
    ids = TokenSource(None, TINY_VOCAB).ids(48)
    cfg = get_preset("kvzip", keep_ratio=0.5, on_infeasible="best_effort")
    snap, _ = prefill_snapshot(loaded.model, None, TINY_VOCAB, ids, [cfg])
    assert "reconstruction" not in snap.states[0].stats  # the snapshot has no scores: the pass must make them
    built = compressed_cache(loaded.model, snap, cfg, "sdpa")
    try:
        assert built.reconstruct_s > 0
        held = built.cache.valid_slots_per_layer()
        assert all(0 < h <= 24 for h in held)
    finally:
        built.cache.close()


def test_kv_bytes_match_hand_computed_sizes(tiny_results):
    results, _ = tiny_results
    geo = results["models"]["tiny"]["geometry"]
    L, H, D, T = geo["num_layers"], geo["num_kv_heads"], geo["head_dim"], 64
    full_bytes = L * 2 * H * T * D * 4  # float32 keys + values
    runs = {r["method"]: r for r in results["runs"]}
    assert runs["full-stock"]["kv_bytes_full"] == full_bytes == runs["full-stock"]["kv_bytes_held"]
    assert runs["full"]["kv_bytes_full"] == full_bytes
    assert runs["full"]["kv_bytes_held"] == full_bytes + L * H * T * 4  # + float32 log-sizes
    comp = runs["streamingllm"]
    slots = comp["slots"]["tensor_slots_max"]
    assert slots == T // 2  # budget 0.5 of 64 tokens, every head alike
    assert comp["kv_bytes_held"] == L * H * slots * (2 * D * 4 + 4)
    assert comp["kv_bytes_allocated"] >= comp["kv_bytes_held"]
    assert comp["kv_bytes_held_end"] > comp["kv_bytes_held"]  # the decode steps appended slots


def test_floors_not_measured_without_their_cells(tiny_results):
    results, _ = tiny_results
    floors = {f["name"]: f for f in results["floors"]}
    assert floors["kv_bytes"]["pass"] is True
    for name in ("attention_32k", "tpot_smollm2_8k", "compression_overhead_8k"):
        assert floors[name]["pass"] is None


def _run(model, length, method, budget, backend, *, tpot, held, full, att=None, compress_s=0.0):
    return {"model": model, "length": length, "method": method, "budget": budget, "backend": backend,
            "tpot": {"median_ms": tpot}, "kv_bytes_held": held, "kv_bytes_full": full, "kv_bytes_allocated": held,
            "attention": {} if att is None else {"min_ms": att}, "compress_s": compress_s, "budget_met": True}


def test_floors_against_hand_made_runs():
    W, full = 600, 400
    runs = [
        _run("smollm2", 8192, "full-stock", None, "stock-sdpa", tpot=12.0, held=full, full=full),
        _run("smollm2", 8192, "full", None, "sdpa", tpot=10.0, held=full, full=full),
        # bound (600 + 400) / (600 + 100) = 1.4286; 10 / 7.5 = 1.333 >= 0.9 * 1.4286 = 1.2857
        _run("smollm2", 8192, "a", 0.25, "sdpa", tpot=7.5, held=100, full=full, compress_s=1.0),
        _run("smollm2", 8192, "a", 0.25, "flex", tpot=8.0, held=100, full=full, compress_s=1.0),
        # bound 1000 / 720 = 1.389; 10 / 8.5 = 1.176 < 0.9 * 1.389 = 1.25; held 120 > 1.05 * 100
        _run("smollm2", 8192, "b", 0.25, "sdpa", tpot=8.5, held=120, full=full, compress_s=3.0),
        _run("llama3-synthetic", 32768, "full-stock", None, "stock-sdpa", tpot=1, held=8, full=8, att=9.0),
        _run("llama3-synthetic", 32768, "full", None, "sdpa", tpot=1, held=8, full=8, att=12.0),
        _run("llama3-synthetic", 32768, "a", 0.25, "sdpa", tpot=1, held=2, full=8, att=2.9),
        _run("llama3-synthetic", 32768, "b", 0.25, "sdpa", tpot=1, held=2, full=8, att=3.1),
    ]
    contexts = [{"model": "smollm2", "length": 8192, "prefill_s": 40.0}]
    floors = {f["name"]: f for f in evaluate(runs, contexts, {"smollm2": W})}
    tpot = {i["preset"]: i for i in floors["tpot_smollm2_8k"]["items"]}
    assert math.isclose(tpot["a"]["bound"], 1000 / 700, rel_tol=1e-3)
    assert math.isclose(tpot["a"]["speedup"], 10 / 7.5, rel_tol=1e-3)  # best full vs best backend
    assert tpot["a"]["pass"] is True and tpot["b"]["pass"] is False
    assert floors["tpot_smollm2_8k"]["pass"] is False
    att = {i["preset"]: i for i in floors["attention_32k"]["items"]}
    assert math.isclose(att["a"]["speedup"], 9.0 / 2.9, rel_tol=1e-3) and att["a"]["pass"] is True
    assert att["b"]["pass"] is False  # 9 / 3.1 < 3
    comp = {i["preset"]: i for i in floors["compression_overhead_8k"]["items"]}
    assert comp["a"]["pass"] is True and comp["b"]["pass"] is False  # 1/40 < 5% <= 3/40
    kv = {(i["model"], i["preset"]): i for i in floors["kv_bytes"]["items"]}
    assert kv[("smollm2", "a")]["pass"] is True and kv[("smollm2", "b")]["pass"] is False
    assert len(floors["kv_bytes"]["items"]) == 4  # one per compressed state, not per backend


def test_clone_is_independent_and_decodes_identically():
    loaded = load("tiny")
    model = loaded.model
    ids = TokenSource(None, TINY_VOCAB).ids(49)
    snap = C.random_snapshot(model, ids[:, :48], TINY_VOCAB, seed=1)
    built = C.compressed_cache(model, snap, _preset("streamingllm", 0.5), "sdpa")
    twin = C.clone_cache(built.cache, model)
    key = cache_kwarg(model)
    try:
        with torch.inference_mode():
            a = model(input_ids=ids[:, 48:], **{key: built.cache}).logits
            assert twin.num_tokens == 48 and built.cache.num_tokens == 49
            b = model(input_ids=ids[:, 48:], **{key: twin}).logits
        torch.testing.assert_close(a, b)
        assert twin.layers[0]._k.data_ptr() != built.cache.layers[0]._k.data_ptr()
    finally:
        built.cache.close()
        twin.close()


def _preset(name, budget):
    from kvcompress.presets import get_preset

    return get_preset(name, keep_ratio=budget)


def test_stock_and_uncompressed_caches_give_the_same_logits():
    model = load("tiny").model
    ids = TokenSource(None, TINY_VOCAB).ids(33)
    snap = C.random_snapshot(model, ids[:, :32], TINY_VOCAB)
    stock = C.stock_cache(model, snap)
    plain = C.uncompressed_cache(model, snap, "sdpa")
    key = cache_kwarg(model)
    with torch.inference_mode():
        a = model(input_ids=ids[:, 32:], **{key: stock}).logits
        b = model(input_ids=ids[:, 32:], **{key: plain}).logits
    plain.close()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert C.kv_bytes(stock)["held"] == sum(2 * s.keys.numel() * 4 for s in snap.states) + 2 * 2 * 2 * 32 * 4


def test_weight_bytes_count_a_tied_head_once_and_skip_an_untied_embedding():
    tied = tiny_llama(len(TINY_VOCAB))
    total = sum(p.numel() * 4 for p in tied.parameters())  # parameters() yields a tied matrix once
    assert weight_bytes_per_token(tied) == total
    untied = tiny_llama(len(TINY_VOCAB))
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    emb = untied.get_input_embeddings().weight.numel() * 4
    assert weight_bytes_per_token(untied) == sum(p.numel() * 4 for p in untied.parameters()) - emb


def test_peak_rss_sees_a_torch_allocation():
    with PeakRSS() as mem:
        x = torch.ones(16 * 1024 * 1024)  # 64 MiB, touched
        del x
    if mem.method.startswith("ru_maxrss"):
        pytest.skip("no resettable RSS high-water mark on this OS")
    assert mem.delta >= 60 * 1024 * 1024
    with PeakRSS() as small:
        torch.ones(16)
    assert small.delta < 16 * 1024 * 1024


def test_token_source_without_tokenizer_has_delimiters_and_is_deterministic():
    src = TokenSource(None, TINY_VOCAB, seed=3)
    ids = src.ids(600)
    assert ids.shape == (1, 600) and int(ids.max()) < len(TINY_VOCAB)
    delimiters = (ids >= len(TINY_VOCAB) - 8).float().mean()
    assert 0.03 < float(delimiters) < 0.2
    assert torch.equal(ids, TokenSource(None, TINY_VOCAB, seed=3).ids(600))


def test_summarize():
    s = summarize([0.003, 0.001, 0.002])
    assert s["median_ms"] == 2.0 and s["min_ms"] == 1.0 and s["max_ms"] == 3.0 and s["mean_ms"] == 2.0
    assert summarize([])["median_ms"] is None


def test_cli_parses_lengths_quick_mode_and_registers_the_command():
    from kvcompress import cli, cli_bench

    assert cli_bench._ints("2k, 512,8K") == (2048, 512, 8192)
    with pytest.raises(ValueError, match="length"):
        cli_bench._ints("2x")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli_bench.add_parser(sub)
    args = parser.parse_args(["bench", "--quick", "--models", "tiny", "--budgets", "0.5,0.2"])
    assert args.func is cli_bench.run
    s = cli_bench.settings_from_args(args)
    assert s.lengths == (512,) and s.budgets == (0.5, 0.2) and s.decode_tokens == 3 and not s.profile
    assert s.presets == ("semanticache",)
    assert "bench" in cli.command_modules()


@pytest.mark.parametrize("field,value", [("budgets", (1.5,)), ("backends", ("cuda",)), ("presets", ("nope",)),
                                         ("models", ("gpt5",)), ("decode_tokens", 0)])
def test_bad_settings_name_the_parameter(field, value):
    with pytest.raises(ValueError, match=field.rstrip("s")):
        BenchSettings(**{**TINY, field: value})


def test_plots_are_written(tiny_results, tmp_path):
    pytest.importorskip("matplotlib")
    from kvcompress.bench.plots import plot_results

    results, _ = tiny_results
    paths = plot_results(results, tmp_path, prefix="eff")
    assert sorted(p.name for p in paths) == ["eff_memory_tiny.png", "eff_tpot_tiny.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_merged_results_keep_every_run_and_reevaluate_floors(tiny_results):
    from kvcompress.bench.report import markdown
    from kvcompress.bench.runner import merge_results

    results, _ = tiny_results
    other = json.loads(json.dumps(results))
    for r in other["runs"]:
        r["length"] = 128
    merged = merge_results([results, other])
    assert len(merged["runs"]) == 2 * len(results["runs"]) and len(merged["parts"]) == 2
    kv = next(f for f in merged["floors"] if f["name"] == "kv_bytes")
    assert {i["length"] for i in kv["items"]} == {64, 128}
    text = markdown(merged)
    assert "## Floors" in text and "| streamingllm 0.5 |" in text and "## tiny: TPOT" in text


def test_recorded_command_is_the_one_typed(tiny_results, tmp_path, monkeypatch):
    """Through ``kvcompress bench`` (sys.argv[1] is the subcommand) the command is recorded once."""
    from kvcompress import cli

    _, out = tiny_results
    merged = tmp_path / "merged.json"
    argv = ["bench", "--merge", str(out), "--out", str(merged), "--no-plots"]
    monkeypatch.setattr("sys.argv", ["kvcompress", *argv])
    assert cli.main(argv) == 0
    assert json.loads(merged.read_text())["merged_by"] == "kvcompress " + " ".join(argv)


def test_kv_floor_reports_the_keep_the_method_reached():
    runs = [_run("smollm2", 2048, "a", 0.2, "sdpa", tpot=1.0, held=140, full=500)]
    runs[0].update(keep_mean=0.279, keep_max=0.28)
    item = next(f for f in evaluate(runs, [], {}) if f["name"] == "kv_bytes")["items"][0]
    assert item["pass"] is False and item["keep_achieved_mean"] == 0.279 and item["held_over_full"] == 0.28


# ---------------------------------------------------------------------------- the true baseline
def test_every_run_is_measured_against_plain_transformers_and_the_bandwidth_floor(tiny_results):
    results, _ = tiny_results
    ctx = results["contexts"][0]
    assert ctx["bandwidth_gbps"] > 0 and len(ctx["round_load_average"]) == TINY["decode_tokens"]
    W = results["models"]["tiny"]["weights_bytes_per_token"]
    plain = next(r for r in results["runs"] if r["method"] == "full-stock")
    for r in results["runs"]:
        ratios = r["tpot_vs_plain"]["per_round"]
        assert len(ratios) == TINY["decode_tokens"]
        expected = [p / t for p, t in zip(plain["tpot"]["steps_ms"], r["tpot"]["steps_ms"])]
        assert all(math.isclose(a, b, rel_tol=0.02, abs_tol=1e-3) for a, b in zip(ratios, expected))
        floor = r["bandwidth_floor"]
        assert floor["bytes_read"] == W + r["kv_bytes_held"]
        assert math.isclose(floor["floor_ms"], floor["bytes_read"] / (ctx["bandwidth_gbps"] * 1e9) * 1e3,
                            rel_tol=1e-3, abs_tol=1e-3)
        assert math.isclose(floor["share_of_floor"], floor["floor_ms"] / r["tpot"]["median_ms"], rel_tol=0.02,
                            abs_tol=2e-4)
    assert plain["tpot_vs_plain"]["per_round"] == [1.0] * TINY["decode_tokens"]


def test_the_plain_twin_runs_no_kvcompress_code_while_a_cache_is_bound_to_the_model():
    """Every Python function called while the twin decodes a stock DynamicCache, with a kvcompress
    cache bound (hooks installed, kvcompress attention selected) on the original model: none may
    come from the kvcompress package. The twin shares the original's weights."""
    import os
    import sys

    import kvcompress
    from transformers import DynamicCache

    from kvcompress.hf import CompressedCache

    loaded = load("tiny")
    model = loaded.model
    twin = C.plain_twin(model)
    assert C.shares_weights(twin, model) and twin.config._attn_implementation == "sdpa"
    bound = CompressedCache.for_model(model, None, "streamingllm", vocab=loaded.vocab)
    ids = torch.randint(0, len(TINY_VOCAB), (1, 12))
    package = os.path.dirname(os.path.abspath(kvcompress.__file__))
    seen = []

    def tracer(frame, event, arg):
        if event == "call" and os.path.abspath(frame.f_code.co_filename).startswith(package):
            seen.append(frame.f_code.co_name)

    cache = DynamicCache(config=model.config)
    key = cache_kwarg(twin)
    with torch.inference_mode():
        sys.setprofile(tracer)
        try:
            out = twin(input_ids=ids, use_cache=True, **{key: cache})
            twin(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{key: cache})
        finally:
            sys.setprofile(None)
        ref = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): bound}).logits
    assert seen == []
    assert torch.allclose(out.logits, ref, atol=1e-5)  # same weights, same numbers (kvcompress attention)
    assert model.config._attn_implementation != "sdpa"  # the original is left as it was
    bound.close()


def test_bandwidth_measurement_and_floor_arithmetic():
    from kvcompress.bench.bandwidth import floor_ms, measure_bandwidth

    bw = measure_bandwidth(1 << 22, reps=2)
    assert bw["bytes"] == 1 << 22 and bw["gbps"] == max(bw["sum_gbps"], bw["gemv_gbps"]) > 0
    assert math.isclose(floor_ms(2_000_000_000, 4.0), 500.0)
    with pytest.raises(ValueError, match="reps"):
        measure_bandwidth(1 << 22, reps=0)


def test_bandwidth_floor_against_hand_made_runs():
    def run(method, budget, backend, tpot, share):
        r = _run("smollm2", 8192, method, budget, backend, tpot=tpot, held=100, full=400)
        r["bandwidth_floor"] = {"share_of_floor": share, "floor_ms": share * tpot}
        r["tpot_vs_plain"] = {"median": 1.0}
        return r

    runs = [run("full-stock", None, "stock-sdpa", 12.0, 0.5), run("a", 0.25, "sdpa", 8.0, 0.85),
            run("a", 0.25, "flex", 9.0, 0.75), run("b", 0.25, "sdpa", 8.0, 0.79)]
    floor = next(f for f in evaluate(runs, [], {"smollm2": 600}) if f["name"] == "bandwidth_smollm2_8k")
    items = {i["method"]: i for i in floor["items"]}
    assert items["a"]["pass"] is True and items["a"]["backend"] == "sdpa"  # best backend
    assert items["b"]["pass"] is False and items["full-stock"]["pass"] is None
    assert floor["pass"] is False


# ---------------------------------------------------------------------------- compression cost
def test_cost_helpers_on_tiny_states():
    from kvcompress.bench import cost
    from kvcompress.presets import get_preset

    assert math.isclose(cost.loglog_slope([1000, 2000, 4000], [1.0, 2.0, 4.0]), 1.0)
    assert math.isclose(cost.loglog_slope([1000, 2000, 4000], [1.0, 4.0, 16.0]), 2.0)
    ids = TokenSource(None, TINY_VOCAB).ids(256)
    states = cost.synthetic_states(256, heads=2, head_dim=16, q_heads=4, window=8, layers=2, token_ids=ids,
                                   vocab=TINY_VOCAB)
    assert states[0].keys.shape == (1, 2, 256, 16) and states[0].extras["queries"].shape == (1, 4, 8, 16)
    configs = {n: get_preset(n, keep_ratio=0.25, on_infeasible="best_effort")
               for n in ("semanticache-safe", "h2o", "centroidkv", "kvzip-gsc", "centroidkv-fitted", "kvzip-hybrid",
                         "kvzip-copy-heads")}
    fed = cost.with_inputs(states, configs["h2o"])  # window 64 > 8: the queries are repeated
    assert fed[0].extras["queries"].shape[2] == 64 and fed[0].stats["attn_acc"].shape == (1, 2, 256)
    assert "reconstruction" not in fed[0].stats  # h2o reads no reconstruction scores
    # a longer recorded window is cut to the pipeline's own (the last queries), as a cache records it
    long_q = [st.replace(extras={"queries": torch.randn(1, 4, 80, 16)}) for st in states]
    safe = cost.with_inputs(long_q, configs["semanticache-safe"])  # query window 32
    assert torch.equal(safe[0].extras["queries"], long_q[0].extras["queries"][:, :, -32:])
    assert "queries" not in cost.with_inputs(long_q, configs["centroidkv"])[0].extras  # needs none
    assert "attn_acc" not in states[0].stats  # the caller's states are untouched
    rec_fed = cost.with_inputs(states, configs["kvzip-gsc"])
    assert rec_fed[0].stats["reconstruction"].shape == (1, 2, 256) and bool((rec_fed[0].stats["reconstruction"] >= 0).all())
    assert "surprisal" not in rec_fed[0].extras  # kvzip-gsc needs no surprisal
    assert rec_fed[0].extras["reconstruction_copy"].shape == (1, 2)  # the pass's copy score per KV head
    assert "reconstruction_copy" not in fed[0].extras
    sur_fed = cost.with_inputs(states, configs["kvzip-hybrid"])  # needs the prefill surprisal: [B, T], every layer
    assert sur_fed[0].extras["surprisal"].shape == (1, 256) and sur_fed[1].extras["surprisal"] is sur_fed[0].extras["surprisal"]
    gen = torch.Generator().manual_seed(0)
    states = [st.replace(extras={**st.extras, "reference_queries": torch.randn(1, 4, 64, 16, generator=gen)})
              for st in states]  # what the recorder keeps for the fitted merger
    doc = cost.cost_rounds(lambda: (2.0, 1.0), configs, states, rounds=2)
    for name, rec in doc["presets"].items():
        assert len(rec["shares"]) == 2 and all(math.isclose(s, c / 2.0) for s, c in zip(rec["shares"], rec["compress_s"]))
        cpu = [r["compress_cpu_s"][name] for r in doc["rounds"]]
        assert all(math.isclose(s, c / 1.0) for s, c in zip(rec["cpu_shares"], cpu))
    assert "cpu_share_median" not in cost.cost_rounds(lambda: 2.0, {"h2o": configs["h2o"]}, states, 1)["presets"]["h2o"]
    scal = cost.scaling({"centroidkv": configs["centroidkv"]}, [128, 256], reps=1, heads=2, head_dim=16, q_heads=4, reference=True,
                        window=8)
    assert len(scal["centroidkv"]["seconds"]) == 2 and math.isfinite(scal["centroidkv"]["slope"])
    ref = scal[cost.REFERENCE]  # the linear pass timed beside it, same lengths and reps
    assert len(ref["all_cpu_seconds"]) == 2 and all(len(x) == 1 for x in ref["all_cpu_seconds"])


def _doc_commands(prefix: str) -> list[list[str]]:
    """Every command of docs/performance.md's bash blocks that starts with ``prefix``
    (continuation lines joined), split like a shell would, without the prefix."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            for part in re.split(r"\s*&&\s*", line):
                part = re.sub(r"^(HF_HUB_OFFLINE=1\s+|nice -n \d+\s+)+", "", part)
                if part.startswith(prefix):
                    out.append(shlex.split(part[len(prefix):]))
    return out


def test_performance_page_commands_parse():
    """The commands docs/performance.md says the figures came from are valid for the scripts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cost", Path(__file__).resolve().parents[1]
                                                  / "benchmarks" / "bench_cost.py")
    bench_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cost)
    cost_cmds = _doc_commands("python benchmarks/bench_cost.py")
    assert len(cost_cmds) >= 3
    for argv in cost_cmds:
        bench_cost.parser().parse_args(argv)
    spec = importlib.util.spec_from_file_location("bench_decode_share", Path(__file__).resolve().parents[1]
                                                  / "benchmarks" / "bench_decode_share.py")
    share = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(share)
    share_cmds = _doc_commands("python benchmarks/bench_decode_share.py")
    assert share_cmds
    for argv in share_cmds:
        share.parser().parse_args(argv)
    from kvcompress import cli_bench

    bench_cmds = _doc_commands("python -m kvcompress.cli bench") + _doc_commands("kvcompress bench")
    assert bench_cmds
    for argv in bench_cmds:
        parser = argparse.ArgumentParser()
        cli_bench.add_parser(parser.add_subparsers())
        cli_bench.settings_from_args(parser.parse_args(["bench", *argv]))


def test_floors_table_reports_the_bandwidth_floor():
    from kvcompress.bench import report

    floors = {"floors": [{"name": "bandwidth_smollm2_8k", "rule": "r", "pass": False, "items": [
        {"method": "semanticache", "backend": "sdpa", "share_of_floor": 0.2, "tpot_vs_plain": 1.5, "pass": False},
        {"method": "full-stock", "backend": "stock-sdpa", "share_of_floor": 0.16, "tpot_vs_plain": 1.0, "pass": None}]}]}
    text = report.floors_table(floors)
    assert "semanticache (sdpa): 20% of the floor, 1.5x plain" in text and "**FAIL**" in text


@pytest.mark.parametrize("argv", [["--length", "3"], ["--budget", "0"], ["--rounds", "0"], ["--presets", "bogus"]])
def test_decode_share_refuses_bad_arguments_before_loading(argv, monkeypatch, capsys):
    """bench_decode_share.py: a bad value is one usage error, exit 2, and no model is loaded."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_decode_share", Path(__file__).resolve().parents[1]
                                                  / "benchmarks" / "bench_decode_share.py")
    share = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(share)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(share, "load", no_model)
    with pytest.raises(SystemExit) as exit_:
        share.main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cost_ab_rejects_bad_arguments_before_any_work():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cost_ab", Path(__file__).resolve().parents[1]
                                                  / "benchmarks" / "bench_cost_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    for argv in (["--modules", "kvcompress.strategies.d2o", "--presets", "no-such-preset"],
                 ["--modules", "kvcompress.strategies.d2o", "--presets", "d2o", "--reps", "0"]):
        with pytest.raises(SystemExit) as exc:
            ab.main(argv)
        assert exc.value.code == 2


def test_cost_bench_rejects_bad_arguments_before_the_model_loads():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cost", Path(__file__).resolve().parents[1]
                                                  / "benchmarks" / "bench_cost.py")
    bench_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cost)
    for argv in (["--presets", "no-such-preset"], ["--flop-bounds", "-1"], ["--reconstruction", "-1"],
                 ["--threads", "0"], ["--keep", "1.5"]):
        with pytest.raises(SystemExit) as exc:
            bench_cost.main(argv)
        assert exc.value.code == 2


def test_smollm2_synthetic_has_smollm2s_geometry_and_random_weights():
    from kvcompress.bench.sources import TINY_VOCAB, load

    loaded = load("smollm2-synthetic", tokenizer=None, seed=0)
    cfg = loaded.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == len(loaded.vocab) and not loaded.prefill
    assert loaded.vocab == TINY_VOCAB or len(loaded.vocab) == 49152  # SmolLM2's tokenizer where installed
    assert "random weights" in loaded.description
