"""The vLLM plugin's engine-free parts: settings, the block rule, compaction in a paged cache and
the per-step plan. Plain torch + the core (no vLLM needed); the engine itself is tested by
tests_vllm/ in its own virtualenv (.ci/vllm)."""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import BPE_VOCAB, CORE_SETTINGS, random_keys
from hypothesis import given
from hypothesis import strategies as st

import kvcompress.vllm as kvv
from kvcompress.attention import proportional_attention
from kvcompress.pipeline import Pipeline
from kvcompress.types import NEG_INF, KVState
from kvcompress.vllm.compaction import PagedLayer, compress_prompt, keep_within, prompt_slots, read_states
from kvcompress.vllm.runtime import Record, WorkerState
from kvcompress.vllm.settings import BlockRule, Settings, parse_budget


@pytest.fixture(autouse=True)
def _quiet_budgets():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---------------------------------------------------------------------------- settings
def test_parse_budget():
    assert parse_budget("0.25") == 0.25 and parse_budget(" 512 ") == 512 and parse_budget(0.5) == 0.5
    assert parse_budget(None) is None
    with pytest.raises(ValueError, match="budget"):
        parse_budget("a quarter")


def test_settings_from_env_and_config():
    env = {"KVCOMPRESS_VLLM_PRESET": "centroidkv", "KVCOMPRESS_VLLM_BUDGET": "0.5", "KVCOMPRESS_VLLM_FREE": "0",
           "KVCOMPRESS_VLLM_OVERRIDES": '{"recent": 8}'}
    s = Settings.from_env(env)
    assert (s.preset, s.budget, s.free_blocks, dict(s.overrides)) == ("centroidkv", 0.5, False, {"recent": 8})
    assert s.config().recent == 8 and s.config().keep_ratio == 0.5
    assert not Settings.from_env({}).enabled and Settings.from_env({}).pipeline() is None
    # additional_config wins over the environment, keys it leaves out come from it
    cfg = SimpleNamespace(additional_config={"kvcompress": {"preset": "semanticache", "budget": 64}})
    got = Settings.from_vllm_config(cfg)
    assert (got.preset, got.budget, got.free_blocks) == ("semanticache", 64, True)
    assert Settings.from_mapping(got.to_dict()) == got and got.key() == Settings.from_mapping(got.to_dict()).key()


@pytest.mark.parametrize("data, name", [
    ({"preset": "semanticach"}, "preset"),
    ({"preset": "semanticache", "budget": 1.5}, "budget"),
    ({"preset": "semanticache", "bugdet": 0.5}, "kvcompress"),
    ({"preset": "semanticache", "overrides": [1]}, "overrides"),
])
def test_bad_settings_name_the_parameter(data, name):
    with pytest.raises(ValueError, match=name):
        Settings.from_mapping(data)


def test_bad_env_values():
    with pytest.raises(ValueError, match="KVCOMPRESS_VLLM_FREE"):
        Settings.from_env({"KVCOMPRESS_VLLM_PRESET": "semanticache", "KVCOMPRESS_VLLM_FREE": "maybe"})
    with pytest.raises(ValueError, match="KVCOMPRESS_VLLM_OVERRIDES"):
        Settings.from_env({"KVCOMPRESS_VLLM_PRESET": "semanticache", "KVCOMPRESS_VLLM_OVERRIDES": "{recent: 8"})


@pytest.mark.parametrize("preset, why", [("h2o", "accumulated attention"), ("kvzip", "model pass")])
def test_pipelines_the_plugin_cannot_feed_are_refused(preset, why):
    with pytest.raises(ValueError, match=why):
        Settings(preset, 0.5).pipeline()


def test_engine_and_request_kwargs():
    kw = kvv.engine_kwargs("semanticache", 0.25)
    assert kw["worker_cls"] == "kvcompress.vllm.worker.CPUWorker" and kw["enable_prefix_caching"] is False
    assert kw["additional_config"]["kvcompress"]["budget"] == 0.25
    gpu = kvv.engine_kwargs("semanticache", 0.25, device="cuda")
    assert gpu["worker_cls"].endswith("GPUWorker") and gpu["attention_backend"] == "FLEX_ATTENTION"
    assert kvv.request_args("centroidkv", 0.5) == {"kvcompress": {"preset": "centroidkv", "budget": 0.5}}
    with pytest.raises(ValueError, match="device"):
        kvv.engine_kwargs(device="tpu")
    with pytest.raises(ValueError, match="preset"):
        kvv.request_args("nope")


# ---------------------------------------------------------------------------- the block rule
@CORE_SETTINGS
@given(P=st.integers(1, 5000), keep=st.floats(0.01, 1.0), bs=st.sampled_from([1, 16, 32]))
def test_block_rule_is_the_pipelines_budget(P, keep, bs):
    rule = BlockRule.of(Settings("semanticache", keep))
    pipeline = Settings("semanticache", keep).pipeline()
    state = KVState.from_raw(torch.zeros(1, 1, P, 1), torch.zeros(1, 1, P, 1))
    assert rule.frees and rule.kept(P) == min(P, int(pipeline.target_slots(state)[0, 0]))
    free = rule.freed(P, bs)
    assert free * bs <= P - rule.kept(P) < (free + 1) * bs


def test_block_rule_slot_budget():
    rule = BlockRule.of(Settings("centroidkv", 100))
    assert rule.kept(2048) == 100 and rule.freed(2048, 32) == (2048 - 100) // 32 and rule.kept(60) == 60


@pytest.mark.parametrize("settings", [
    Settings("semanticache", 0.25, free_blocks=False),
    Settings(None, None),
    Settings("semanticache", 0.25, overrides={"full_heads": ((0, 1),)}),  # a full head keeps everything
    Settings("snapkv", 0.25, overrides={"clusterer.head_budget": "adaptive-sum"}),  # Ada-KV summed: counts vary
])
def test_block_rule_frees_nothing_where_the_size_is_unknown(settings):
    rule = BlockRule.of(settings)
    assert not rule.frees and rule.kept(2048) == 2048 and rule.freed(2048, 32) == 0


# ---------------------------------------------------------------------------- compaction
L, H, D, BS, NUM_BLOCKS = 3, 2, 8, 4, 12


def _paged(seed: int):
    gen = torch.Generator().manual_seed(seed)
    slots = NUM_BLOCKS * BS
    keys = random_keys(gen, 1, L * H, slots, D)[0].reshape(L, H, slots, D).permute(0, 2, 1, 3).contiguous()
    values = torch.randn(L, slots, H, D, generator=gen)
    bias = torch.randn(slots, L * H, generator=gen)
    layers = [PagedLayer(keys=keys[i], values=values[i], bias=bias[:, i * H:(i + 1) * H]) for i in range(L)]
    return layers, (keys, values, bias)


def _tokens(seed: int, P: int) -> torch.Tensor:
    return torch.randint(0, len(BPE_VOCAB), (P,), generator=torch.Generator().manual_seed(seed + 1))


def test_prompt_slots_follow_the_block_table():
    slots = prompt_slots([7, 2, 9], 10, 4)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    with pytest.raises(ValueError, match="block_ids"):
        prompt_slots([7, 2], 10, 4)


@pytest.mark.parametrize("preset, budget", [("semanticache", 0.5), ("centroidkv", 0.25), ("streamingllm", 6)])
def test_compaction_attends_like_the_compressed_state(preset, budget):
    """Attention over the request's paged slots (in position order, with the written bias) equals
    proportional attention over the pipeline's compressed state; nothing outside the request's
    slots changes; the blocks in front of the kept slots hold nothing the request attends to."""
    P, block_ids = 18, [7, 2, 9, 4, 11]
    layers, (keys, values, bias) = _paged(0)
    slots = prompt_slots(block_ids, P, BS)
    ids = _tokens(0, P)
    settings = Settings(preset, budget, overrides={"sinks": 1, "recent": 2})
    expected = [Settings(preset, budget, overrides={"sinks": 1, "recent": 2}).pipeline().compress(s, i)[0]
                for i, s in enumerate(read_states(layers, slots, ids[None], BPE_VOCAB))]
    before = (keys.clone(), values.clone(), bias.clone())
    rule = BlockRule.of(settings)
    result = compress_prompt(settings.pipeline(), layers, slots, BS, token_ids=ids, vocab=BPE_VOCAB,
                             max_slots=rule.kept(P))
    assert result.slots_per_layer == [e.num_slots for e in expected] and result.trimmed_layers == 0
    assert max(result.slots_per_layer) <= rule.kept(P)
    assert result.dead_blocks == (P - max(result.slots_per_layer)) // BS >= rule.freed(P, BS)
    others = torch.ones(NUM_BLOCKS * BS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(keys[:, others], before[0][:, others]) and torch.equal(values[:, others], before[1][:, others])
    assert torch.equal(bias[others], before[2][others])
    q = torch.randn(1, 2 * H, 3, D, generator=torch.Generator().manual_seed(5))  # GQA: 2 query heads per KV head
    dead_slots = slots[: result.dead_blocks * BS]
    for i, (layer, want) in enumerate(zip(layers, expected)):
        assert bool((layer.bias[dead_slots] == NEG_INF).all())
        live = slots[result.dead_blocks * BS:]  # what the backend still reads
        got = proportional_attention(q, layer.keys[live].permute(1, 0, 2)[None], layer.values[live].permute(1, 0, 2)[None],
                                     layer.bias[live].t()[None].contiguous(), causal=False)
        ref = proportional_attention(q, want.keys, want.values, want.log_sizes, causal=False)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_full_preset_is_a_no_op():
    P = 13
    layers, (keys, values, bias) = _paged(1)
    slots = prompt_slots([3, 0, 5, 8], P, BS)
    before = (keys.clone(), values.clone())
    result = compress_prompt(Settings("full", None).pipeline(), layers, slots, BS, token_ids=_tokens(1, P),
                             vocab=BPE_VOCAB)
    assert result.slots_per_layer == [P] * L and result.dead_blocks == 0
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])
    assert bool((bias[slots] == 0).all())


def test_an_unreachable_budget_is_cut_to_the_block_rule():
    """recent=8 > a budget of 4: the pipeline keeps more than the freed blocks leave room for,
    so the layer is cut to the sinks and the most recent slots."""
    P = 16
    layers, _ = _paged(2)
    slots = prompt_slots([1, 6, 3, 10], P, BS)
    settings = Settings("streamingllm", 4, overrides={"sinks": 1, "recent": 8})
    result = compress_prompt(settings.pipeline(), layers, slots, BS, token_ids=_tokens(2, P), vocab=BPE_VOCAB,
                             max_slots=4)
    assert result.trimmed_layers == L and result.slots_per_layer == [4] * L and result.dead_blocks == 3
    for layer in layers:
        assert bool((layer.bias[slots[:12]] == NEG_INF).all()) and bool((layer.bias[slots[12:]] == 0).all())


def _keep_within_reference(state: KVState, limit: int, sinks: int) -> list[list[list[int]]]:
    out = []
    for b in range(state.batch_size):
        rows = []
        for h in range(state.num_heads):
            valid = [(int(state.positions[b, h, n]), n) for n in range(state.num_slots) if bool(state.valid[b, h, n])]
            valid.sort()
            first = valid[:sinks]
            rest = valid[sinks:]
            keep = first + rest[max(0, len(rest) - (limit - len(first))):] if limit > len(first) else valid[:limit]
            rows.append([int(state.positions[b, h, n]) for _, n in sorted(keep)])
        out.append(rows)
    return out


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), N=st.integers(2, 20), limit_frac=st.floats(0.05, 0.95), sinks=st.integers(0, 4))
def test_keep_within_matches_a_slow_reference(seed, N, limit_frac, sinks):
    gen = torch.Generator().manual_seed(seed)
    B, Hh = 2, 3
    limit = max(1, int(N * limit_frac))
    positions = torch.stack([torch.stack([torch.randperm(N, generator=gen) for _ in range(Hh)]) for _ in range(B)])
    log_sizes = torch.randn(B, Hh, N, generator=gen).abs()
    log_sizes = log_sizes.masked_fill(torch.rand(B, Hh, N, generator=gen) < 0.2, NEG_INF)  # some padding
    positions = positions.masked_fill(log_sizes == NEG_INF, -1)
    keys = torch.randn(B, Hh, N, 4, generator=gen)
    state = KVState(keys=keys, values=keys * 2, log_sizes=log_sizes, positions=positions, num_tokens=N)
    k, v, ls = keep_within(state, limit, sinks)
    assert k.shape == (B, Hh, limit, 4) and ls.shape == (B, Hh, limit)
    want = _keep_within_reference(state, limit, sinks)
    for b in range(B):
        for h in range(Hh):
            got = []
            for n in range(limit):
                if ls[b, h, n] == NEG_INF:
                    continue
                src = int((keys[b, h] == k[b, h, n]).all(-1).nonzero()[0])  # which slot it came from
                assert ls[b, h, n] == log_sizes[b, h, src] and torch.equal(v[b, h, n], 2 * keys[b, h, src])
                got.append(int(positions[b, h, src]))
            assert got == want[b][h]


def test_compaction_is_all_or_nothing():
    P = 12
    layers, (keys, values, bias) = _paged(3)
    slots = prompt_slots([2, 5, 8], P, BS)
    inner = Settings("semanticache", 0.5).pipeline()

    class Failing:
        config, needs_all_layers = inner.config, False

        def compress(self, state, layer_idx):
            if layer_idx == L - 1:
                raise ValueError("layer 2 fails")
            return inner.compress(state, layer_idx)

    before = (keys.clone(), values.clone(), bias.clone())
    with pytest.raises(ValueError, match="layer 2"):
        compress_prompt(Failing(), layers, slots, BS, token_ids=_tokens(3, P), vocab=BPE_VOCAB)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1]) and torch.equal(bias, before[2])


# ---------------------------------------------------------------------------- one engine step
def _runner(reqs: dict):
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(reqs)), requests={
        rid: SimpleNamespace(req_id=rid, num_prompt_tokens=P, num_computed_tokens=done,
                             sampling_params=SimpleNamespace(extra_args=extra))
        for rid, (P, done, extra) in reqs.items()})


def test_plan_step_finds_finishing_prompts_query_rows_and_dead_blocks():
    state = WorkerState(settings=Settings("snapkv", 0.5), block_size=BS, num_layers=L)  # query_window 32
    state.runner = _runner({"decoding": (100, 120, None), "chunk1": (200, 0, None), "last": (100, 60, None),
                            "short": (10, 0, None)})
    state.records["decoding"] = Record(prompt_tokens=100, dead_blocks=12, slots_per_layer=[50] * L,
                                       settings=state.settings)
    state.scheduled = {"decoding": 1, "chunk1": 64, "last": 40, "short": 10}
    plan = state.plan_step(4)
    assert plan.dead_blocks.tolist() == [12, 0, 0, 0]
    assert [f[:2] for f in plan.finishing] == [("last", 100), ("short", 10)]
    # rows: decoding 0, chunk1 1..64, last 65..104 (positions 60..99: the last 32 are rows 73..104), short 105..114
    got = {rid: (rows.tolist(), pos.tolist()) for rid, rows, pos in plan.captures}
    assert got == {"last": (list(range(73, 105)), list(range(68, 100))), "short": (list(range(105, 115)), list(range(10)))}
    assert state.plan_step(4) is plan and state.max_batch == 4


def test_reference_positions_are_the_transformers_rule():
    from kvcompress.hf.attention import strided_queries
    from kvcompress.vllm.runtime import reference_positions

    for P, R in [(1000, 64), (50, 64), (7, 1), (2, 3), (2048, 64)]:
        q = torch.arange(P, dtype=torch.float32).reshape(1, 1, P, 1)
        assert reference_positions(P, R).tolist() == strided_queries(q, R, None)[0, 0, :, 0].long().tolist()


# the fitted presets default to the layer's last queries (the query window); these tests pin the
# strided prefill sample, the path that needs reference queries collected across steps
PREFILL_QUERIES = {"merger.queries": "prefill", "merger.reference_queries": 64}


def test_queries_are_kept_across_the_steps_of_a_chunked_prefill():
    """semanticache-fitted on strided prefill queries needs 64 reference queries: they come from every chunk."""
    from kvcompress.vllm.runtime import reference_positions

    state = WorkerState(settings=Settings("semanticache-fitted", 0.5, overrides=PREFILL_QUERIES),
                        block_size=BS, num_layers=L)
    P, Hq = 300, 4
    full = torch.randn(P, Hq, D)  # the query of every prompt position (one layer)
    for done, n in [(0, 128), (128, 128), (256, 44)]:
        state.runner = _runner({"r": (P, done, None)})
        state.scheduled = {"r": n}
        state.plan = None
        plan = state.plan_step(1)
        for layer in range(L):
            state.capture_queries(layer, full[done:done + n] + layer, plan.captures)
        assert [f[0] for f in plan.finishing] == (["r"] if done + n >= P else [])
        state.end_step()
    want = reference_positions(P, 64)
    for layer in range(L):
        torch.testing.assert_close(state.queries_at("r", layer, want), full[want] + layer)
    state.finished("r")
    assert state.queries_at("r", 0, want) is None and "r" not in state.chosen


def test_fitted_compaction_uses_the_reference_queries():
    """A fitted merger's bias (not log(count)) is what the paged cache attends with."""
    P, block_ids = 18, [7, 2, 9, 4, 11]
    layers, _ = _paged(4)
    slots = prompt_slots(block_ids, P, BS)
    ids = _tokens(4, P)
    settings = Settings("semanticache-fitted", 0.5, overrides={"sinks": 1, "recent": 2, **PREFILL_QUERIES})
    pipeline = settings.pipeline()
    R = pipeline.needs.reference_queries
    gen = torch.Generator().manual_seed(9)
    reference = [torch.randn(R, 2 * H, D, generator=gen) for _ in range(L)]
    states = read_states(layers, slots, ids[None], BPE_VOCAB, reference=reference)
    assert states[0].extras["reference_queries"].shape == (1, 2 * H, R, D)
    expected = [settings.pipeline().compress(s, i)[0] for i, s in enumerate(states)]
    assert any(bool(((e.log_sizes - e.token_counts().log()).abs() > 1e-4)[e.valid].any()) for e in expected)
    result = compress_prompt(pipeline, layers, slots, BS, token_ids=ids, vocab=BPE_VOCAB, reference=reference,
                             max_slots=BlockRule.of(settings).kept(P))
    for layer, want, n in zip(layers, expected, result.slots_per_layer):
        torch.testing.assert_close(layer.bias[slots[P - n:]].t(), want.log_sizes[0])


def test_request_settings_are_capped_by_the_engine_rule():
    state = WorkerState(settings=Settings("semanticache", 0.5), block_size=BS, num_layers=L)
    def req(extra):
        return SimpleNamespace(req_id="r", num_prompt_tokens=1000, sampling_params=SimpleNamespace(extra_args=extra))
    assert state.request_settings(req(None)) is state.settings
    smaller = state.request_settings(req(kvv.request_args("centroidkv", 0.25)))
    assert (smaller.preset, smaller.budget) == ("centroidkv", 0.25)
    assert state.request_settings(req(kvv.request_args("centroidkv", 0.75))) is state.settings  # needs freed blocks
    assert state.request_settings(req({"kvcompress": {"preset": "h2o"}})) is state.settings  # unsupported: ignored
    no_free = WorkerState(settings=Settings("semanticache", 0.5, free_blocks=False), block_size=BS, num_layers=L)
    bigger = no_free.request_settings(req(kvv.request_args("centroidkv", 0.75)))
    assert bigger.budget == 0.75 and not math.isnan(bigger.budget)


def test_flat_extra_args_from_the_openai_server():
    base = Settings("semanticache", 0.5)
    assert Settings.from_extra_args(None, base) is None and Settings.from_extra_args({"other": 1}, base) is None
    flat = Settings.from_extra_args({"kvcompress_preset": "centroidkv", "kvcompress_budget": "0.25",
                                     "kvcompress_overrides": '{"recent": 4}'}, base)
    assert (flat.preset, flat.budget, dict(flat.overrides)) == ("centroidkv", 0.25, {"recent": 4})
    assert Settings.from_extra_args({"kvcompress_budget": 0.25}, base).preset == "semanticache"
    with pytest.raises(ValueError, match="kvcompress_overrides"):
        Settings.from_extra_args({"kvcompress_overrides": "{recent"}, base)
    state = WorkerState(settings=base, block_size=BS, num_layers=L)
    got = state.request_settings(SimpleNamespace(req_id="r", num_prompt_tokens=500,
                                                 sampling_params=SimpleNamespace(extra_args={"kvcompress_budget": 0.25})))
    assert (got.preset, got.budget) == ("semanticache", 0.25)


def test_the_serve_example_builds_the_documented_command(capsys):
    import importlib.util
    import shlex
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "vllm_serve.py"
    spec = importlib.util.spec_from_file_location("example_vllm_serve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no vLLM import at module level
    result = module.main(["--preset", "centroidkv", "--budget", "512", "--model", "/models/m", "--serve-command"])
    argv = shlex.split(result["command"])
    assert argv[:3] == ["vllm", "serve", "/models/m"] and "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--worker-cls") + 1] == "kvcompress.vllm.worker.CPUWorker"
    config = json.loads(argv[argv.index("--additional-config") + 1])["kvcompress"]
    assert (config["preset"], config["budget"]) == ("centroidkv", 512)
    assert result["command"] in capsys.readouterr().out
    with pytest.raises(ValueError, match="preset"):
        module.main(["--preset", "h2", "--model", "/m", "--serve-command"])


def test_reuse_of_freed_blocks_is_noticed():
    state = WorkerState(settings=Settings("semanticache", 0.5), block_size=BS, num_layers=L)
    runner = _runner({"old": (16, 20, None), "new": (16, 0, None)})
    runner.requests["old"].block_ids = ([3, 4, 5, 6, 7, 8],)
    runner.requests["new"].block_ids = ([9, 4, 10, 11],)  # block 4 came back to the pool and was reused
    state.runner = runner
    state.records["old"] = Record(prompt_tokens=16, dead_blocks=2, slots_per_layer=[8] * L, settings=state.settings,
                                  freed_ids=frozenset({3, 4}))
    state.scheduled = {"old": 1, "new": 16}
    state.plan_step(2)
    assert state.reused == {4}


def test_convert_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    """A user's folder holding anything else is never replaced (the converter would delete it):
    a ValueError naming ``target``, the folder untouched; on the CLI one line and exit 2, as for
    an unknown option."""
    from kvcompress.vllm import convert

    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="target"):
        convert.smollm2_folder(mine)
    assert convert.main([str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "target" in err[0]
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    with pytest.raises(SystemExit) as bad:
        convert.main(["--bogus"])
    assert bad.value.code == 2
