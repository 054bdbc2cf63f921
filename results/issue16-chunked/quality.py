"""What chunking costs: the same compression one-shot (one prefill, then compression) and chunked
(``cache.prefill(ids, chunk=C)``, compressed after every chunk), on a small NIAH slice and a
fidelity window. Run from the repository root:

    python results/issue16-chunked/quality.py --out results/issue16-chunked/quality.json

NIAH: 2k-token Paul Graham haystacks, number needle at depths 0.3 / 0.7, query-agnostic (the
question follows the compressed context), greedy answer, hit = the value in the answer.
Fidelity: a 1000-token prefix compressed, 100 continuation tokens teacher forced in one forward;
KL(full || compressed) of the next-token distributions, top-1 agreement. Keep 0.25, chunk 512
(NIAH) / 256 (fidelity), one thread, sdpa. Resumable: records are appended to OUT.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

PRESETS = ("centroidkv", "semanticache-safe")
KEEP = 0.25
HAYSTACK = "/work/shared/data/paul_graham_essays"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/issue16-chunked/quality.json")
    ap.add_argument("--niah-chunk", type=int, default=512)
    ap.add_argument("--fidelity-chunk", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kvcompress.eval.data import Haystack
    from kvcompress.eval.fidelity import compare, fidelity_windows
    from kvcompress.eval.greedy import build_prompt, greedy, stop_ids
    from kvcompress.eval.niah import niah_samples
    from kvcompress.eval.scoring import hit
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg
    from kvcompress.hf.loading import load_model

    log = args.out.replace(".json", ".jsonl")
    done = set()
    if os.path.exists(log):
        done = {json.loads(line)["key"] for line in open(log)}
    model, tok = load_model()
    hay = Haystack.load(HAYSTACK)
    key_arg = cache_kwarg(model)

    def record(rec):
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    stop = stop_ids(tok)
    for sample in niah_samples(tok, hay, [2048], [0.3, 0.7], samples=1, kind="number"):
        prompt = build_prompt(tok, sample.context, sample.question)
        for preset in PRESETS:
            for chunk in (None, args.niah_chunk):
                key = f"niah|{sample.sample_id}|{preset}|{chunk}"
                if key in done:
                    continue
                cache = CompressedCache.for_model(model, tok, preset, backend="sdpa", keep_ratio=KEEP)
                start = time.perf_counter()
                cache.prefill(prompt.head, chunk=chunk)
                prefill_s = time.perf_counter() - start
                keep = max(cache.slots_per_layer()) / prompt.head.shape[1]
                new, _ = greedy(model, cache, prompt.tail, sample.max_new_tokens, stop)
                answer = tok.decode(new, skip_special_tokens=True)
                record({"key": key, "task": "niah", "sample": sample.sample_id, "preset": preset, "chunk": chunk,
                        "answer": answer, "hit": hit(answer, sample.answers[0]), "keep_max": round(keep, 4),
                        "prefill_s": round(prefill_s, 2), "compress_s": round(cache.stats["compress_s"], 3)})
                cache.close()

    for sample_id, ids in fidelity_windows(tok, hay, 1000, 100, samples=1):
        prefix, cont, targets = ids[:, :1000], ids[:, 1000:-1], ids[0, 1001:]

        def logits_after(preset, chunk):
            cache = CompressedCache.for_model(model, tok, preset, backend="sdpa",
                                              **({} if preset is None else {"keep_ratio": KEEP}))
            cache.prefill(prefix, chunk=chunk)
            with torch.inference_mode():
                out = model(input_ids=cont, use_cache=True, **{key_arg: cache}).logits[0].float()
            cache.close()
            return out

        ref = logits_after(None, None)
        for preset in PRESETS:
            for chunk in (None, args.fidelity_chunk):
                key = f"fidelity|{sample_id}|{preset}|{chunk}"
                if key in done:
                    continue
                rec = compare(ref, logits_after(preset, chunk), targets)
                record({"key": key, "task": "fidelity", "sample": sample_id, "preset": preset, "chunk": chunk, **rec})
    summarize(log, args.out)


def summarize(log: str, out: str) -> None:
    recs = [json.loads(line) for line in open(log)]
    rows = {}
    for r in recs:
        row = rows.setdefault((r["task"], r["preset"]), {"task": r["task"], "preset": r["preset"]})
        mode = "one_shot" if r["chunk"] is None else f"chunk{r['chunk']}"
        if r["task"] == "niah":
            row.setdefault(f"hits_{mode}", 0)
            row.setdefault("n", 0)
            row[f"hits_{mode}"] += int(r["hit"])
            row["n"] += int(mode == "one_shot")
        else:
            row[f"kl_{mode}"] = round(r["kl"], 5)
            row[f"top1_{mode}"] = round(r["top1"], 3)
    json.dump({"what": "chunked vs one-shot compression, SmolLM2-135M float32, 1 thread, keep 0.25",
               "load_average": os.getloadavg(), "summary": list(rows.values()), "records": recs},
              open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
