"""kvcompress.viz / cli_viz: the membership it shows is what the pipeline merged, and the HTML / PNG
show every token, the clusters, the anchors and the chunk boundaries."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvcompress as kc
from kvcompress import ClusterPlan, Pipeline
from kvcompress.strategies.mergers import apply_merge_plan
from kvcompress.viz import ROLES, _shown, cluster_view, render_html, render_png

WORDS = ("the", "cat", "sat", "on", "mat", "dog", "ran", "far", "big", "red")
DELIMS = (".", ",")
TOY_VOCAB = WORDS + DELIMS  # ids 0..11; 10 and 11 are delimiters
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def toy_state(seed: int, N: int = 90, H: int = 2, D: int = 8, every: int = 9) -> kc.KVState:
    """Random keys around a few prototypes, words with a delimiter every ``every`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randn(4, D, generator=gen)
    keys = protos[torch.randint(0, 4, (1, H, N), generator=gen)] + 0.5 * torch.randn(1, H, N, D, generator=gen)
    values = torch.randn(1, H, N, D, generator=gen)
    ids = torch.randint(0, len(WORDS), (1, N), generator=gen)
    ids[0, every - 1::every] = len(WORDS)  # "."
    return kc.KVState.from_raw(keys, values, token_ids=ids, vocab=TOY_VOCAB)


def check_membership(pipe: Pipeline, state: kc.KVState, head: int) -> None:
    """Every slot's merged key equals the plain mean of the ORIGINAL keys of the tokens the view
    assigns to it (sizes start at 1, and size-weighted means compose across rounds), and the view
    accounts for every token exactly once."""
    view, _ = cluster_view(pipe, state, layer_idx=0, head=head)
    out, _ = pipe.compress(state, 0)
    N = state.num_tokens
    sizes = torch.round(out.log_sizes[0, head].exp()).long()
    covered = 0
    for slot in range(out.num_slots):
        members = (view.slot_of == slot).nonzero().flatten()
        assert len(members) == int(sizes[slot]), (slot, members, sizes[slot])
        covered += len(members)
        if len(members):
            torch.testing.assert_close(out.keys[0, head, slot], state.keys[0, head, members].mean(0),
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.values[0, head, slot], state.values[0, head, members].mean(0),
                                       atol=1e-5, rtol=1e-5)
            rep = int(out.positions[0, head, slot])
            assert rep in members.tolist()
            assert (view.rep_position[members] == rep).all()
            assert (view.cluster_size[members] == len(members)).all()
    dropped = int((view.slot_of == -1).sum())
    assert covered + dropped == N
    assert [r == "dropped" for r in view.roles] == (view.slot_of == -1).tolist()


@pytest.mark.parametrize("preset", ["semanticache", "semanticache-fixed64", "semanticache-global", "centroidkv",
                                    "centroidkv-chunk16"])
def test_membership_is_what_the_pipeline_merged(preset):
    state = toy_state(0, N=150)
    pipe = Pipeline(preset, keep_ratio=0.5, recent=8, on_infeasible="best_effort")
    for head in range(state.num_heads):
        check_membership(pipe, state, head)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), keep=st.sampled_from([0.3, 0.5, 0.8]),
       preset=st.sampled_from(["semanticache", "centroidkv-chunk16"]))
def test_membership_property(seed, keep, preset):
    state = toy_state(seed, N=70, every=5)
    pipe = Pipeline(preset, keep_ratio=keep, recent=6, sinks=2, on_infeasible="best_effort")
    check_membership(pipe, state, head=seed % state.num_heads)


def test_roles_against_a_slow_reference():
    state = toy_state(3, N=60)
    pipe = Pipeline("semanticache", keep_ratio=0.6, sinks=3, recent=7)
    view, report = cluster_view(pipe, state, head=1)
    ids = state.token_ids[0].tolist()
    N = len(ids)
    for t, role in enumerate(view.roles):
        if t < 3:
            assert role == "sink"
        elif t >= N - 7:
            assert role == "recent"
        elif TOY_VOCAB[ids[t]] in DELIMS:
            assert role == "anchor"
        else:
            assert role in ("merged", "kept")
            assert (role == "merged") == (int(view.cluster_size[t]) > 1)
    # chunks: a clustered token's chunk is the number of delimiters before it
    delims_before = 0
    for t in range(N):
        if TOY_VOCAB[ids[t]] in DELIMS:
            delims_before += 1
        elif view.roles[t] in ("merged", "kept"):
            assert int(view.chunk_ids[t]) == delims_before
        else:
            assert int(view.chunk_ids[t]) == -1
    # no cluster crosses a chunk
    for members in view.clusters():
        assert len({int(view.chunk_ids[t]) for t in members}) == 1
    assert view.summary()["slots"] == int(report.slots_per_head[0, 1])


_SPAN = re.compile(r"<span class='(tok[^']*)' data-pos='(\d+)' data-chunk='(-?\d+)' style='[^']*'"
                   r"(?: data-slot='(\d+)')? title='[^']*'>(.*?)</span>", re.S)


def parse_tokens(page: str) -> list[tuple[set, int, int, int | None, str]]:
    return [(set(c.split()), int(p), int(ch), None if s == "" else int(s), html.unescape(text))
            for c, p, ch, s, text in _SPAN.findall(page)]


def test_html_shows_every_token_clusters_anchors_and_boundaries():
    vocab = TOY_VOCAB + ("<b>&\n",)  # text that must be escaped, and a newline
    state = toy_state(5, N=80)
    ids = state.token_ids.clone()
    ids[0, 30] = len(vocab) - 1
    state = kc.KVState.from_raw(state.keys, state.values, token_ids=ids, vocab=vocab)
    pipe = Pipeline("semanticache", keep_ratio=0.5, recent=8)
    view, _ = cluster_view(pipe, state, head=0)
    page = render_html(view)
    spans = parse_tokens(page)
    assert [p for _, p, _, _, _ in spans] == list(range(80))
    # whitespace made visible: a newline shows as a return arrow, then breaks the line
    assert [t for *_, t in spans] == [_shown(text) + ("\n" if "\n" in text else "") for text in view.texts]
    assert "<b>&" not in page.split("<div class='text'>")[1].split("</div>")[0]  # escaped
    for classes, pos, chunk, slot, _ in spans:
        role = view.roles[pos]
        assert f"role-{role}" in classes
        assert chunk == int(view.chunk_ids[pos])
        assert slot == (int(view.slot_of[pos]) if int(view.slot_of[pos]) >= 0 else None)
        assert ("rep" in classes) == (role == "merged" and int(view.rep_position[pos]) == pos)
    anchors = [pos for classes, pos, *_ in spans if "role-anchor" in classes]
    delimiter_positions = [p for p in range(4, 80 - 8) if any(d in vocab[int(ids[0, p])] for d in ".\n")]
    assert 30 in anchors and anchors == delimiter_positions  # the fused "<b>&\n" token too
    # a cluster span: several tokens share a data-slot
    slots = [slot for *_, slot, _ in spans if slot is not None]
    assert max(slots.count(s) for s in set(slots)) > 1
    # one boundary bar per change of chunk among clustered tokens
    changes = 0
    last = None
    for t in range(80):
        c = int(view.chunk_ids[t])
        if c >= 0:
            changes += last is not None and c != last
            last = c
    assert page.count("<span class='cut'></span>") == changes + 1  # +1: the legend's sample bar


@dataclass(frozen=True)
class _DropOdd:
    """Test clusterer: evict every odd clusterable slot."""

    def __call__(self, state, chunk_ids, target, round_idx=0):
        N = state.num_slots
        slot = torch.arange(N)
        parent = torch.where(state.valid, slot, -1)
        return ClusterPlan(torch.where((chunk_ids >= 0) & (slot % 2 == 1), -1, parent), done=True)


@dataclass(frozen=True)
class _ForgetStats:
    """Test merger that rebuilds the state without its per-slot stats."""

    def __call__(self, state, parent):
        return apply_merge_plan(state, parent).replace(stats={})


@pytest.fixture
def test_strategies():
    kc.register_clusterer("test-viz-drop-odd")(_DropOdd)
    kc.register_merger("test-viz-forget")(_ForgetStats)
    yield
    kc.CLUSTERERS.unregister("test-viz-drop-odd")
    kc.MERGERS.unregister("test-viz-forget")


def test_dropped_and_untracked_tokens(test_strategies):
    state = toy_state(1, N=40)
    pipe = Pipeline({"keep_ratio": 1.0, "sinks": 2, "recent": 4, "chunker": "global",
                     "clusterer": "test-viz-drop-odd", "merger": "mean"})
    view, _ = cluster_view(pipe, state, head=0)
    for t, role in enumerate(view.roles):
        if 2 <= t < 36:
            assert role == ("dropped" if t % 2 else "kept"), (t, role)
    page = render_html(view)
    assert "role-dropped" in page

    pipe = Pipeline({"keep_ratio": 0.5, "sinks": 2, "recent": 4, "chunker": "global",
                     "clusterer": {"name": "gsc"}, "merger": "test-viz-forget"})
    view, _ = cluster_view(pipe, state, head=0)
    out, _ = pipe.compress(state)
    reps = set(out.positions[0, 0].tolist())
    for t, role in enumerate(view.roles):
        if 2 <= t < 36 and t not in reps:
            assert role == "untracked"
    assert set(view.roles) <= set(ROLES)


def test_bad_input():
    state = toy_state(0, N=30)
    pipe = Pipeline("semanticache", recent=4, on_infeasible="best_effort")
    with pytest.raises(ValueError, match="head=5"):
        cluster_view(pipe, state, head=5)
    with pytest.raises(ValueError, match="texts"):
        cluster_view(pipe, state, texts=["a"] * 3)
    compressed, _ = pipe.compress(state)
    with pytest.raises(ValueError, match="uncompressed"):
        cluster_view(pipe, compressed)


# ------------------------------------------------------------------------------ with a model
def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def toy_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(TOY_VOCAB + ("[UNK]",))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


TOY_TEXT = " ".join(
    "the cat sat on the mat . the dog ran far , the big red dog sat . the cat ran on the red mat ."
    .split() * 3)


def test_png_and_html_from_a_tiny_model(tmp_path):
    from kvcompress.viz import visualize_text

    tokenizer = toy_tokenizer()
    model = tiny_llama(len(tokenizer))
    view = visualize_text(model, tokenizer, TOY_TEXT, "semanticache", layer_idx=1, head=1,
                          html_path=tmp_path / "v.html", png_path=tmp_path / "v.png", recent=8, keep_ratio=0.6)
    assert (tmp_path / "v.png").read_bytes()[:8] == PNG_MAGIC
    page = (tmp_path / "v.html").read_text()
    words = TOY_TEXT.split()
    assert [t for *_, t in parse_tokens(page)] == words
    assert view.roles.count("anchor") == sum(w in DELIMS for w in words[4:-8])
    assert "merged" in view.roles


@pytest.mark.parametrize("preset", ["semanticache-safe", "centroidkv-safe"])
def test_cross_layer_guard_presets_from_a_tiny_model(tmp_path, preset):
    """The -safe presets' sentence guard decides from every layer's queries: viz runs the real
    cache (queries captured, guards prepared from all layers), as `kvcompress viz --preset
    semanticache-safe` does."""
    from kvcompress.viz import visualize_text

    tokenizer = toy_tokenizer()
    model = tiny_llama(len(tokenizer))
    view = visualize_text(model, tokenizer, TOY_TEXT, preset, layer_idx=1, head=0,
                          png_path=tmp_path / "s.png", recent=8, sinks=2, keep_ratio=0.5)
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC
    assert view.report["budget_met"] and "merged" in view.roles
    assert view.roles.count("protected") > 0  # the guard kept some sentences whole


def test_png_of_a_long_text_is_truncated(tmp_path):
    state = toy_state(2, N=300)
    view, _ = cluster_view(Pipeline("centroidkv-chunk16", keep_ratio=0.4), state)
    out = render_png(view, tmp_path / "long.png", max_tokens=120, chars_per_line=60)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_on_a_saved_tiny_model(tmp_path, capsys):
    from kvcompress import cli_viz

    tokenizer = toy_tokenizer()
    model = tiny_llama(len(tokenizer))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    args = ["--text", TOY_TEXT, "--preset", "centroidkv-chunk16", "--keep-ratio", "0.5", "--set", "recent=8",
            "--set", "sinks=2", "--layer", "1", "--head", "0", "--model", str(tmp_path / "m"),
            "--html", str(tmp_path / "c.html"), "--png", str(tmp_path / "c.png")]
    assert cli_viz.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tokens"] == len(TOY_TEXT.split()) and summary["budget_met"] is True
    assert summary["slots"] <= len(TOY_TEXT.split()) // 2
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    assert "data-slot" in (tmp_path / "c.html").read_text()

    assert cli_viz.main(["--text", "x", "--model", str(tmp_path / "m")]) == 2  # no output path
    assert "--html/--png" in capsys.readouterr().err
    assert cli_viz.main(["--text", "x", "--html", "x.html", "--set", "recent"]) == 2
    assert "FIELD=VALUE" in capsys.readouterr().err


def test_add_parser_wires_a_subcommand():
    import argparse

    from kvcompress import cli_viz

    parser = argparse.ArgumentParser(prog="kvcompress")
    cli_viz.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["viz", "--text", "hi", "--png", "a.png", "--layer", "3"])
    assert args.func is cli_viz.run and args.layer == 3 and args.preset == "semanticache"


def test_eviction_and_cam_presets():
    state = toy_state(4, N=60)
    view, _ = cluster_view(Pipeline("streamingllm", keep_ratio=0.5), state, head=0)
    # 4 sinks, the middle evicted, the most recent 26 kept alone
    assert view.roles == ("sink",) * 4 + ("dropped",) * 30 + ("kept",) * 26

    queries = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with_q = state.replace(extras={"queries": queries})
    pipe = Pipeline("cam", keep_ratio=0.5, query_window=8, **{"clusterer.merge_rule": "always"})
    view, _ = cluster_view(pipe, with_q, head=1)
    out, _ = pipe.compress(with_q)
    kept_positions = set(out.positions[0, 1].tolist())
    merged = [t for t, r in enumerate(view.roles) if r == "merged" and t not in kept_positions]
    assert merged, "CaM with merge_rule='always' merges every evicted value"
    for t in merged:  # shown with a kept slot after it (CaM spreads values forward)
        assert int(view.rep_position[t]) > t
    assert "dropped" not in view.roles
