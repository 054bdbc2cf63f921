"""Issue 14 evaluation on SmolLM2: fidelity (teacher-forced KL, top-1) + greedy generation agreement,
and a small agnostic NIAH slice, through the live cache (CompressedCache.for_model: the prefill
records each layer's reference queries and compresses at its end), one process, resumable.

    python results/issue14-eval/run.py fidelity --haystack PATH|pydoc --presets a,b --budgets 0.5,0.25 \
        --samples 2 --out results/issue14-eval/fidelity-pg.jsonl
    python results/issue14-eval/run.py niah --lengths 2048 --depths 0.1,0.5,0.9 --presets ... --out ...

Fidelity follows `kvcompress eval fidelity` (same windows: prefix 1000, continuation 500, KL(full ||
compressed) over the continuation fed teacher-forced in one forward with compression off after the
prefix). Generation: greedy 64 tokens after the compressed prefix (decode-time compression on, as in
use) against the full cache's 64: leading identical tokens and LCS / 64.
(`kvcompress eval` replays a recorder's snapshot into each compressed copy, which does not carry
reference queries yet: eval/caches.py is issue 13's; this script uses the live path instead.)
"""
import argparse, json, os, random, sys, time
from pathlib import Path
sys.path.insert(0, ".")
import torch
from kvcompress.hf import CompressedCache
from kvcompress.hf.loading import load_model
from kvcompress.hf.generate import cache_kwarg
from kvcompress.presets import get_preset
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import fidelity_windows, compare
from kvcompress.eval.greedy import greedy, build_prompt, stop_ids
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.scoring import score
from kvcompress.eval.agreement import lcs_length as lcs, leading_match as leading



def make_cache(model, tok, preset, budget):
    """preset: a name, or name@key=value;key=value (get_preset overrides, e.g. merger.ridge=0)."""
    name, _, rest = preset.partition("@")
    over = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in rest.split(";") if kv)}
    cfg = get_preset(name, keep_ratio=budget, **over) if name != "full" else get_preset("full")
    return CompressedCache.for_model(model, tok, cfg, backend="sdpa")


def feed(model, cache, ids, logits=False):
    module = model if logits else model.base_model
    with torch.inference_mode():
        out = module(input_ids=ids, use_cache=True, **{cache_kwarg(module): cache})
    return out.logits[0].float() if logits else None


def keep_of(cache):
    ratios = [float(l.valid_slots().float().max()) / max(l.num_tokens, 1) for l in cache.layers]
    return max(ratios)


def fidelity(a, model, tok, store, done):
    hay = Haystack.load(None if a.haystack == "pydoc" else a.haystack)
    windows = fidelity_windows(tok, hay, a.prefix, a.continuation, a.samples, a.seed)
    for sid, ids in windows:
        pre, cont, targets = ids[:, :a.prefix], ids[:, a.prefix:-1], ids[0, a.prefix + 1:]
        ref = None
        for preset in ["full"] + a.presets:
            for budget in ([1.0] if preset == "full" else a.budgets):
                key = f"{hay.name}|{sid}|{preset}|{budget}"
                if key in done and preset != "full":
                    continue
                if preset != "full" and ref is None:
                    ref = done_ref.get(f"{hay.name}|{sid}")
                cache = make_cache(model, tok, preset, budget)
                try:
                    t = time.perf_counter()
                    feed(model, cache, pre)
                    prefill_s = time.perf_counter() - t
                    keep = keep_of(cache)
                    cache.enabled = False
                    logits = feed(model, cache, cont, logits=True)
                finally:
                    cache.close()
                gen_cache = make_cache(model, tok, preset, budget)  # a second prefill (deepcopy: h13, later)
                try:
                    feed(model, gen_cache, pre)
                    gen, _ = greedy(model, gen_cache, ids[:, a.prefix:a.prefix + 1], a.gen_tokens)
                finally:
                    gen_cache.close()
                if preset == "full":
                    ref = (logits, gen)
                    done_ref[f"{hay.name}|{sid}"] = ref
                    continue
                m = compare(ref[0], logits, targets)
                rec = {"key": key, "haystack": hay.name, "sample_id": sid, "preset": preset, "budget": budget,
                       **m, "gen_leading": leading(gen, ref[1]), "gen_lcs": lcs(gen, ref[1]) / a.gen_tokens,
                       "keep_max": round(keep, 4), "prefill_compress_s": round(prefill_s, 3),
                       "loadavg": os.getloadavg()[0], "time": time.strftime("%H:%M:%S")}
                store.write(json.dumps(rec) + "\n"); store.flush()
                print(f"{hay.name[:8]} {sid[-2:]} {preset:26s} {budget:4.2f} KL {m['kl']:.4f} top1 {m['top1']:.3f} "
                      f"lead {rec['gen_leading']:2d} lcs {rec['gen_lcs']:.2f} keep {keep:.3f}", flush=True)


def niah(a, model, tok, store, done):
    hay = Haystack.load(None if a.haystack == "pydoc" else a.haystack)
    samples = niah_samples(tok, hay, a.lengths, a.depths, a.samples, "number", a.seed)
    stop = stop_ids(tok)
    for s in samples:
        prompt = build_prompt(tok, s.context, s.question, None)
        for preset in a.presets:
            for budget in a.budgets:
                key = f"{hay.name}|{s.sample_id}|{preset}|{budget}"
                if key in done:
                    continue
                cache = make_cache(model, tok, preset, budget)
                try:
                    feed(model, cache, prompt.head)
                    new, _ = greedy(model, cache, prompt.tail, s.max_new_tokens, stop)
                finally:
                    cache.close()
                ans = tok.decode(new, skip_special_tokens=True).strip()
                sc = score(ans, list(s.answers), s.metric)
                rec = {"key": key, "haystack": hay.name, "sample_id": s.sample_id, "preset": preset, "budget": budget,
                       **s.meta, "answer": ans, **sc, "time": time.strftime("%H:%M:%S")}
                store.write(json.dumps(rec) + "\n"); store.flush()
                print(f"{s.sample_id} {preset:26s} {budget:4.2f} {'hit' if sc['hit'] else 'miss'} {ans[:60]!r}", flush=True)


done_ref = {}
p = argparse.ArgumentParser()
p.add_argument("task", choices=["fidelity", "niah"])
p.add_argument("--haystack", default="/work/shared/data/paul_graham_essays")
p.add_argument("--presets", required=True)
p.add_argument("--budgets", default="0.5,0.25")
p.add_argument("--samples", type=int, default=2)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--prefix", type=int, default=1000)
p.add_argument("--continuation", type=int, default=500)
p.add_argument("--gen-tokens", type=int, default=64)
p.add_argument("--lengths", default="2048")
p.add_argument("--depths", default="0.1,0.5,0.9")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--out", required=True)
a = p.parse_args()
a.presets = a.presets.split(",")  # a preset spec holds no comma
a.budgets = [float(x) for x in a.budgets.split(",")]
a.lengths = [int(x) for x in a.lengths.split(",")]
a.depths = [float(x) for x in a.depths.split(",")]
torch.set_num_threads(a.threads)
model, tok = load_model()
out = Path(a.out)
done = set()
if out.exists():
    done = {json.loads(l)["key"] for l in out.read_text().splitlines() if l.strip()}
with out.open("a") as store:
    (fidelity if a.task == "fidelity" else niah)(a, model, tok, store, done)
