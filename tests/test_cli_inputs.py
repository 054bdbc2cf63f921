"""The command line fails fast and clean: every bad argument of demo, viz and eval is one line on
stderr naming the argument, the value and what is allowed, exit status 2, before any model loads
(the loaders are replaced by ones that fail the test); --debug shows the traceback; progress goes
to stderr; a finished eval grid loads no model; the GGUF header reader finds the geometry."""

from __future__ import annotations

import json

import pytest

from kvcompress import cli, cli_eval, cli_viz


@pytest.fixture
def no_model(monkeypatch):
    """Any model or tokenizer load fails the test."""
    def boom(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("kvcompress.hf.loading.load_model", boom)
    monkeypatch.setattr("kvcompress.viz.load_model", boom)
    monkeypatch.setattr(cli_eval, "_load", boom)
    monkeypatch.setattr(cli_eval, "load_tokenizer", boom)
    return boom


@pytest.fixture
def model_dir(tmp_path):
    """A model directory holding only its config: enough for the checks, which read no weights."""
    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_key_value_heads": 2,
                                                  "num_attention_heads": 4}))
    return path


def _fails(capsys, argv, *needles, code=2):
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert len(err.splitlines()) == 1, err  # one line, nothing before it (no progress: nothing loaded)
    for needle in needles:
        assert needle in last, (needle, last)
    return last


# ---------------------------------------------------------------------------- demo
def test_demo_arguments_fail_before_the_model_loads(no_model, capsys, tmp_path):
    _fails(capsys, ["demo", "--preset", str(tmp_path / "missing.json")], "missing.json", "existing pipeline JSON")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _fails(capsys, ["demo", "--preset", str(bad)], "bad.json", "readable pipeline JSON")
    _fails(capsys, ["demo", "--preset", "no-such-preset"], "preset='no-such-preset'", "one of")
    _fails(capsys, ["demo", "--set", "clusterer.tau=2"], "--set clusterer.tau=2", "tau=2", "[-1.0, 1.0]")
    _fails(capsys, ["demo", "--set", "chunker.size=0", "--preset", "semanticache-fixed64"], "size=0")
    _fails(capsys, ["demo", "--budget", "20"], "max_slots=20", "sinks + recent = 4 + 32", "keep-ratio")
    _fails(capsys, ["demo", "--budget", "1.5"], "--budget=1.5", "(0, 1]")
    _fails(capsys, ["demo", "--budget", "0"], "--budget=0")
    _fails(capsys, ["demo", "--text", str(tmp_path / "missing.txt")], "--text=", "missing.txt", "an existing file")
    _fails(capsys, ["demo", "--text", str(tmp_path)], "--text=", "directory")
    _fails(capsys, ["demo", "--tokens", "3"], "--tokens=3", ">= 16")
    _fails(capsys, ["demo", "--max-new-tokens", "0"], "--max-new-tokens=0")
    _fails(capsys, ["demo", "--device", "tpu"], "--device='tpu'")
    _fails(capsys, ["demo", "--model", str(tmp_path / "nowhere")], "--model=")


def test_sequences_past_the_context_window_fail_before_anything_loads(no_model, capsys, tmp_path):
    out = ["--out", str(tmp_path / "out")]
    _fails(capsys, ["demo", "--tokens", "9000"], "--tokens=9000", "<= 8192", "context window", "(here 9024)")
    _fails(capsys, ["demo", "--tokens", "8170", "--max-new-tokens", "30"], "--tokens=8170", "(here 8200)")
    _fails(capsys, ["eval", "niah", *out, "--lengths", "2k,8k"], "--lengths='2k,8k'", "8192", "(here 8208)")
    _fails(capsys, ["eval", "ruler", *out, "--lengths", "8190", "--max-new-tokens", "3"], "(here 8193)")
    _fails(capsys, ["eval", "fidelity", *out, "--prefix", "8000"], "--prefix=8000", "--continuation", "(here 8500)")
    _fails(capsys, ["eval", "agreement", *out, "--length", "8190"], "--length=8190", "--new-tokens")
    assert not (tmp_path / "out").exists()
    # a named model's window comes from its config alone
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 256}))
    _fails(capsys, ["demo", "--model", str(small), "--tokens", "300"], "--tokens=300", "<= 256")
    short = tmp_path / "short.txt"
    short.write_text("a short text. " * 10)  # 140 bytes: at most 140 tokens, whatever --tokens says
    assert cli.main(["demo", "--model", str(small), "--text", str(short)]) == 1
    assert "must not be loaded" in capsys.readouterr().err
    # at the window's edge the check passes and the run goes on to load the model
    assert cli.main(["demo", "--tokens", "8168"]) == 1
    assert "must not be loaded" in capsys.readouterr().err


def test_demo_cuda_on_a_build_without_it_fails_before_loading(no_model, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fails(capsys, ["demo", "--device", "cuda"], "--device='cuda'", "no CUDA")
    _fails(capsys, ["demo", "--device", "cuda:1"], "--device='cuda:1'")


def test_debug_shows_the_traceback(no_model, capsys):
    with pytest.raises(ValueError, match="tau=2"):
        cli.main(["demo", "--set", "clusterer.tau=2", "--debug"])
    with pytest.raises(ValueError, match="tau=2"):
        cli.main(["--debug", "demo", "--set", "clusterer.tau=2"])


def test_unexpected_failures_are_one_line_with_status_1(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr("kvcompress.cli_demo.run", broken)
    _fails(capsys, ["demo"], "RuntimeError: something broke", "--debug", code=1)


# ---------------------------------------------------------------------------- viz
def test_viz_arguments_fail_before_the_model_loads(no_model, capsys, tmp_path, model_dir):
    m = ["--model", str(model_dir)]
    html = ["--html", str(tmp_path / "v.html")]
    _fails(capsys, ["viz", "--text", "", *html, *m], "--text=''", "some text")
    _fails(capsys, ["viz", "--text", "   \n", *html, *m], "--text=")
    _fails(capsys, ["viz", "--file", str(tmp_path / "missing.txt"), *html, *m], "--file=", "an existing file")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(capsys, ["viz", "--file", str(empty), *html, *m], "--file=", "empty")
    afile = tmp_path / "afile"
    afile.write_text("x")
    _fails(capsys, ["viz", "--text", "hello there", "--png", str(afile / "v.png"), *m], "--png=", "is a file")
    _fails(capsys, ["viz", "--text", "hello there", "--html", str(tmp_path), *m], "--html=", "not a directory")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--layer", "99"], "--layer=99", "< 2", "2 layers")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--head", "2"], "--head=2", "2 KV heads")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--layer", "-1"], "--layer=-1")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--keep-ratio", "1.5"], "--keep-ratio=1.5", "(0, 1]")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--preset", "nope"], "preset='nope'")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--preset", str(tmp_path / "p.json")], "--preset=")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--set", "clusterer.tau=5"], "tau=5")
    _fails(capsys, ["viz", "--text", "hello there", *html, "--model", str(tmp_path / "nowhere")], "--model=")
    _fails(capsys, ["viz", "--text", "hello there", *html, *m, "--gguf-file", "x.gguf"], "--gguf-file=")
    # the module's own entry point behaves the same
    assert cli_viz.main(["--text", "", *html, *m]) == 2
    assert "--text=''" in capsys.readouterr().err


def test_gguf_header_gives_layers_and_kv_heads(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" for i in range(300)])  # an array of strings before the keys
    writer.add_token_scores([0.5] * 300)
    writer.add_context_length(2048)
    writer.add_name("tiny")
    writer.add_block_count(7)
    writer.add_head_count(6)
    writer.add_head_count_kv(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert cli_viz.gguf_geometry(path) == (7, 3)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope" + bytes(20))
    assert cli_viz.gguf_geometry(bad) is None


# ---------------------------------------------------------------------------- eval
def test_eval_arguments_fail_before_anything_loads(no_model, capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = ["--out", str(tmp_path / "out")]
    _fails(capsys, ["eval", "niah", "--out", str(afile)], "--out=", "a directory")
    _fails(capsys, ["eval", "niah", "--out", str(afile / "sub")], "--out=", "is a file")
    _fails(capsys, ["eval", "niah", *out, "--haystack", str(tmp_path / "none")], "--haystack", "existing directory")
    _fails(capsys, ["eval", "niah", *out, "--override", "clusterer.tau=2", "--presets", "full,semanticache"],
           "method 'semanticache'", "--override", "tau=2")
    _fails(capsys, ["eval", "niah", *out, "--method", "centroidkv:clusterer.r_max=7"], "method 'centroidkv:")
    _fails(capsys, ["eval", "niah", *out, "--presets", "nope"], "method 'nope'", "preset='nope'")
    _fails(capsys, ["eval", "niah", *out, "--budgets", "20"], "--budgets=20", "(0.0, 1.0]")
    _fails(capsys, ["eval", "niah", *out, "--depths", "1.5"], "--depths=1.5")
    _fails(capsys, ["eval", "niah", *out, "--lengths", "4"], "--lengths=4")
    _fails(capsys, ["eval", "niah", *out, "--protocols", "sideways"], "--protocols='sideways'")
    _fails(capsys, ["eval", "niah", *out, "--samples", "0"], "--samples=0")
    _fails(capsys, ["eval", "ruler", *out, "--tasks", "niah_single_number,bogus"], "--tasks=", "among")
    _fails(capsys, ["eval", "fidelity", *out, "--prefix", "1"], "--prefix=1")
    assert not (tmp_path / "out").exists()  # nothing written either
    assert cli_eval.main(["niah", "--out", str(afile)]) == 2  # the module's own entry point too


def test_eval_device_is_checked_before_loading(no_model, capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fails(capsys, ["eval", "niah", "--out", str(tmp_path / "o"), "--device", "cuda"], "--device='cuda'")


def test_eval_help_has_no_internal_note(capsys):
    for argv in (["eval", "--help"], ["viz", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        out = capsys.readouterr().out
        assert "CLI owner" not in out and "add_parser" not in out


# ---------------------------------------------------------------------------- everyday slips
def test_usage_errors_are_one_line_too(no_model, capsys):
    """argparse's own errors (a missing value, a wrong type, an unknown flag or subcommand) say
    where help is, in one line, exit 2, instead of a usage block."""
    for argv, needle in ((["demo", "--budget", "abc"], "--budget"), (["demo", "--tokens", "x"], "--tokens"),
                         (["demo", "--question"], "--question"), (["demo", "--recent", "5"], "--recent"),
                         (["eval"], "niah"), (["eval", "foo"], "'foo'"), (["viz"], "--text"),
                         (["eval", "report"], "--out")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err and "--help)" in err, (argv, err)


def test_threads_are_checked_in_demo_and_viz(no_model, capsys, tmp_path, model_dir):
    _fails(capsys, ["demo", "--threads", "0"], "--threads=0", ">= 1")
    _fails(capsys, ["viz", "--text", "hello there", "--html", str(tmp_path / "v.html"), "--model", str(model_dir),
                    "--threads", "-1"], "--threads=-1")


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs a /proc file system")
def test_outputs_where_nothing_can_be_written_fail_up_front(no_model, capsys, tmp_path, model_dir):
    """Permission bits say /proc is writable for root; a scratch directory tells the truth."""
    _fails(capsys, ["eval", "niah", "--out", "/proc/kvcompress-out"], "--out='/proc/kvcompress-out'", "writable")
    _fails(capsys, ["viz", "--text", "hello there", "--html", "/proc/kvcompress/v.html", "--model", str(model_dir)],
           "--html=", "writable")
    _fails(capsys, ["bench", "--out", "/proc/kvcompress.json"], "--out=", "writable")
    _fails(capsys, ["bench", "--markdown", "/proc/kvcompress.md"], "--markdown=", "writable")
    _fails(capsys, ["bench", "--text", str(tmp_path / "none.txt")], "--text=", "an existing file")
