"""Every preset end to end on one device: prefill a real text, compress, generate, through
``kvcompress.generate``. It checks that nothing mixes devices or dtypes (CPU tests cannot), not
answers: the model may have random weights (``smollm2-synthetic``: SmolLM2's geometry and
tokenizer), so the text is only decoded, not judged.

    python benchmarks/gpu_presets_smoke.py --out gpu_presets.json              # CUDA, bfloat16
    python benchmarks/gpu_presets_smoke.py --device cpu --tokens 300 --presets snapkv semanticache-safe

Per preset: ok or the error, the keep ratio reached, seconds (the first call of a kind compiles or
warms up kernels), and whether the compressed cache's bytes equal keep x the full cache's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="smollm2-synthetic", help="a kvcompress.bench.sources model name")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a saved tokenizer directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--presets", nargs="+", default=None, help="default: every registered preset")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds; later presets are skipped")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_presets_smoke: no CUDA device", file=sys.stderr)
        return 3
    import kvcompress
    from kvcompress.bench.sources import load, read_text
    from kvcompress.presets import list_presets

    tok = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    loaded = load(args.model, dtype=args.dtype, tokenizer=tok)
    model, tok = loaded.model.to(args.device), loaded.tokenizer
    ids = tok(read_text(), add_special_tokens=False)["input_ids"][: args.tokens]
    prompt = tok.decode(ids)
    start = time.perf_counter()
    doc = {"model": loaded.description, "device": str(args.device), "tokens": len(ids), "budget": args.budget,
           "torch": torch.__version__, "presets": {}}
    for name in args.presets or list_presets():
        if time.perf_counter() - start > args.time_limit:
            doc["presets"][name] = {"skipped": "time limit"}
            continue
        t0 = time.perf_counter()
        try:
            text, info = kvcompress.generate(model, tok, prompt, preset=None if name == "full" else name,
                                             budget=None if name == "full" else args.budget,
                                             question="What is this text about?", max_new_tokens=8)
            rec = {"ok": True, "keep": info.get("keep_reached"), "kv_bytes_full": info.get("kv_bytes_full"),
                   "kv_bytes_compressed": info.get("kv_bytes_compressed"), "text": text[:80]}
        except Exception as exc:  # noqa: BLE001 - the point is to record every failure
            rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400],
                   "where": traceback.format_exc().strip().splitlines()[-3:]}
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        doc["presets"][name] = rec
        print(f"{name}: {'ok' if rec['ok'] else rec['error']} ({rec['seconds']} s)", flush=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    bad = [n for n, r in doc["presets"].items() if r.get("ok") is False]
    print(f"{len(doc['presets']) - len(bad)} ok, failed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
