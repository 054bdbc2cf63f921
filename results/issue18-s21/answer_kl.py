"""Dev probe (session 21): fidelity on the full cache's own answer path, a low-noise companion of generation
agreement. Per agreement window (the same windows as ``kvcompress eval agreement --seed S``): the full cache's
greedy answer F (N tokens) to the instruction; then, for each method, the instruction + F teacher-forced over the
compressed context, and against the full cache's logits on the same tokens:

    kl     mean KL(full || compressed) over the N + 1 answer positions (the first predicts F[0])
    top1   share of those positions whose argmax equals the full cache's (F itself, then the stop token)
    lead   the first position where the argmax differs (greedy agreement's ``lead``, without running greedy)

Greedy LCS diverges chaotically after the first differing token; these read every position.

Usage: python results/issue18-s21/answer_kl.py --seed 11 --samples 8 --budgets 0.25 --out F.jsonl \
           --method snapkv --method 'kvzip-copy-heads-aligned:clusterer.threshold=1.0' ...
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from kvcompress.config import StrategySpec
from kvcompress.eval.agreement import INSTRUCTION, agreement_windows
from kvcompress.eval.caches import Recorder, compressed_copy
from kvcompress.eval.data import Haystack
from kvcompress.eval.greedy import build_prompt, greedy, stop_ids
from kvcompress.eval.methods import Method
from kvcompress.eval.reconstruction import copy_for
from kvcompress.hf.generate import cache_kwarg
from kvcompress.hf.loading import load_model


def forced_logits(model, cache, ids):
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0].float()


def parse_variant(spec: str):
    """'METHOD' (eval's --method form) or 'METHOD@k=v,k=v' (the params of the config's first guard changed,
    values as JSON): (label, budget -> PipelineConfig)."""
    method_spec, _, guard = spec.partition("@")
    method = Method.parse(method_spec)
    changes = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in guard.split(",") if kv)}

    def make(budget):
        cfg = method.config(budget)
        if changes:
            g = cfg.guards[0]
            cfg = cfg.replace(guards=(StrategySpec(g.name, {**g.params, **changes}),) + tuple(cfg.guards[1:]))
        return cfg
    return spec, make


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budgets", default="0.25")
    p.add_argument("--method", action="append", required=True)
    p.add_argument("--haystack", default="/work/shared/data/paul_graham_essays")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(None)
    hay = Haystack.load(a.haystack)
    windows = agreement_windows(tok, hay, a.length, a.first + a.samples, a.seed)[a.first:]
    methods = [parse_variant(m) for m in a.method]
    budgets = [float(b) for b in a.budgets.split(",")]
    stop = stop_ids(tok)
    full = Method.parse("full")
    with open(a.out, "a") as fh:
        for sid, text in windows:
            prompt = build_prompt(tok, text, INSTRUCTION)
            configs = {(label, b): make(b) for label, make in methods for b in budgets}
            rec = Recorder.for_configs(model, tok, configs.values(), backend="sdpa")
            try:
                rec.feed(prompt.head)
                snap = rec.snapshot()
            finally:
                rec.close()
            ref = compressed_copy(model, snap, full.config(1.0))
            try:
                answer, _ = greedy(model, ref.cache, prompt.tail, a.new_tokens, stop)
            finally:
                ref.cache.close()
            forced = torch.cat([prompt.tail, torch.tensor([answer])], dim=1)
            ref = compressed_copy(model, snap, full.config(1.0))
            try:
                full_logits = forced_logits(model, ref.cache, forced)[prompt.tail.shape[1] - 1:]
            finally:
                ref.cache.close()
            logp_full = F.log_softmax(full_logits, -1)
            for (label, budget), cfg in configs.items():
                t0 = time.perf_counter()
                copy = copy_for(model, tok, snap, cfg)
                try:
                    logits = forced_logits(model, copy.cache, forced)[prompt.tail.shape[1] - 1:]
                finally:
                    copy.cache.close()
                logp = F.log_softmax(logits, -1)
                kl = (logp_full.exp() * (logp_full - logp)).sum(-1)
                same = logits.argmax(-1) == full_logits.argmax(-1)
                lead = int(same.long().cumprod(0).sum())
                row = {"sample_id": sid, "method": label, "budget": budget, "kl": float(kl.mean()),
                       "top1": float(same.float().mean()), "lead": lead, "positions": int(kl.numel()),
                       "keep_max": round(copy.keep_max, 5), "seed": a.seed, "s": round(time.perf_counter() - t0, 2)}
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
