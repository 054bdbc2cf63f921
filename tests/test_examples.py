"""Every example runs, at small sizes, and prints/returns what it claims.

The examples are run in this process through their ``main(argv)`` (importing them the way
``python examples/<name>.py`` would, with examples/ on sys.path), plus one real subprocess to make
sure a script runs as documented.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcompress as kc

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# examples/vllm_*.py need vLLM: tests/test_vllm_plugin.py and tests_vllm/ run them
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "toy_cache.py" and not p.name.startswith("vllm_"))


def load_example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", EXAMPLES / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def test_every_example_is_tested():
    assert SCRIPTS == ["ablation_chunking.py", "pipeline_from_dict.py", "pipeline_from_json.py"]


def test_pipeline_from_dict(capsys):
    result = load_example("pipeline_from_dict.py").main(["--tokens", "256", "--keep-ratio", "0.3"])
    assert result["budget_met"] and all(s <= int(256 * 0.3) for s in result["slots_per_head"][0])
    assert result["max_attention_gap"] < 1e-5
    out = capsys.readouterr().out
    assert "256 tokens -> slots per head" in out and "sizes add up to 512" in out


def test_pipeline_from_json(tmp_path, capsys):
    module = load_example("pipeline_from_json.py")
    saved = tmp_path / "effective.json"
    result = module.main(["--tokens", "200", "--layers", "2", "--batch", "1", "--save", str(saved),
                          "--set", "keep_ratio=0.5", "--set", "clusterer.r_init=0.3"])
    assert result["kept"] <= result["tokens"] * 0.5
    cfg = kc.PipelineConfig.from_json(saved)
    assert cfg.keep_ratio == 0.5 and cfg.clusterer.params["r_init"] == 0.3
    # the rest comes from the JSON file shipped with the example
    shipped = json.loads((EXAMPLES / "pipeline.json").read_text())
    assert cfg.name == shipped["name"] and cfg.chunker.to_dict() == shipped["chunker"]
    assert "budget met: True" in capsys.readouterr().out


def test_shipped_json_is_a_valid_config():
    cfg = kc.PipelineConfig.from_json(EXAMPLES / "pipeline.json")
    kc.Pipeline(cfg)  # every strategy and parameter resolves


def test_ablation_synthetic(tmp_path):
    module = load_example("ablation_chunking.py")
    out = tmp_path / "abl.json"
    rows = module.main(["--tokens", "256", "--layers", "1", "--keep-ratios", "0.5", "--window", "4",
                        "--json", str(out)])
    assert [r["chunking"] for r in rows] == ["semantic", "fixed-64", "global"]
    for r in rows:
        assert r["context_tokens"] == 252 and r["slots_mean"] <= r["budget_slots"] and r["budget_met"]
        assert 0.0 < r["attn_rel_error"] < 1.0
    assert json.loads(out.read_text())["rows"] == rows


def test_ablation_error_is_zero_without_compression():
    module = load_example("ablation_chunking.py")
    layers = module.synthetic_layers(tokens=128, window=4, layers=1, heads=2, head_dim=16)
    rows = module.run(layers, [1.0])
    assert all(r["attn_rel_error_worst_head"] < 1e-5 and r["slots_mean"] == 124 for r in rows)


def test_ablation_with_a_model(tmp_path, monkeypatch):
    """--model on a tiny random Llama saved to disk: the recorded queries reproduce the model's
    attention, so with nothing compressed the error is ~0, and compression gives a real error."""
    from test_viz import TOY_TEXT, tiny_llama, toy_tokenizer

    tokenizer = toy_tokenizer()
    model = tiny_llama(len(tokenizer))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text(TOY_TEXT)
    module = load_example("ablation_chunking.py")
    rows = module.main(["--model", str(tmp_path / "m"), "--text-file", str(text), "--window", "4",
                        "--keep-ratios", "1.0,0.5", "--layers", "0,1"])
    full = [r for r in rows if r["keep_ratio"] == 1.0]
    half = [r for r in rows if r["keep_ratio"] == 0.5]
    assert all(r["attn_rel_error_worst_head"] < 1e-5 for r in full)
    assert all(r["attn_rel_error"] > 1e-4 for r in half)


def test_record_queries_match_the_model():
    """The queries the ablation records, attended over the recorded cache, give the model's own
    per-head attention output (checked through o_proj on a tiny Llama)."""
    from test_viz import tiny_llama

    module = load_example("ablation_chunking.py")
    model = tiny_llama(32)
    ids = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(0))
    seen = {}
    hook = model.model.layers[1].self_attn.o_proj.register_forward_hook(
        lambda mod, args, out: seen.setdefault("in", args[0].detach()))
    layers = module.record_queries(model, ids, window=5)
    hook.remove()
    keys, values, queries = layers[1]
    out = kc.proportional_attention(queries, keys, values, torch.zeros(keys.shape[:3]), causal=True)
    B, Hq, W, D = out.shape
    assert torch.allclose(out.transpose(1, 2).reshape(B, W, Hq * D), seen["in"][:, -W:], atol=1e-5)


def test_a_script_runs_as_documented():
    done = subprocess.run([sys.executable, str(EXAMPLES / "pipeline_from_dict.py"), "--tokens", "128",
                           "--keep-ratio", "0.5"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "merged vs expanded attention output" in done.stdout


def test_toy_cache_has_sentences():
    from importlib import import_module

    sys.path.insert(0, str(EXAMPLES))
    try:
        toy = import_module("toy_cache")
    finally:
        sys.path.remove(str(EXAMPLES))
    keys, values, ids, vocab = toy.toy_cache(300, heads=2, head_dim=8, batch=2, seed=3)
    assert keys.shape == (2, 2, 300, 8) and ids.shape == (2, 300)
    ends = {vocab.index(d) for d in (".", ".\n", "?", "!")}
    assert any(int(i) in ends for i in ids[0])
    with pytest.raises(ValueError):
        kc.KVState.from_raw(keys, values[..., :4])
