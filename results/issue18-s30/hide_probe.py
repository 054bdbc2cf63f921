"""Which heads must hold a needle near the end of 4k? (session 30 dev probe, diagnosis only; spent windows)

On seed 30's 4k planted-number windows at depth 0.9 the preset's guard chose the needle's sentence (its copy heads
hold it whole) and the answer was still wrong, while protecting the needle in every head (the eval's oracle)
answered. This compresses each window once per variant and, before decoding, hides the needle's own slots (the
slots whose position lies in the needle's span) in a chosen set of (layer, KV head) pairs by setting their log size
to -inf: the attention then gives them no weight, as if they had been dropped.

- oracle: the needle protected everywhere, nothing hidden (expected: answers);
- oracle-copy-only: protected everywhere, hidden in every head but the copy heads;
- oracle-no-copy: protected everywhere, hidden in the copy heads only;
- oracle-early / oracle-late: protected everywhere, hidden in layers 0-14 / 15-29;
- preset: the preset as it is (expected: misses);
- preset-copy-only: the preset, its needle slots hidden outside the copy heads (the partial copies gone);
- oracle-copy-layers: protected everywhere, held only in every head of the layers holding a copy head;
- oracle-top10 / oracle-top20: protected everywhere, held only in the 10% / 20% of heads with the highest copy score;
- oracle-copy-late20: protected everywhere, held only in the copy heads and every head of layers 20-29.

    python results/issue18-s30/hide_probe.py --out results/issue18-s30/probe/hide.jsonl
    python results/issue18-s30/hide_probe.py --variants oracle-copy-layers,oracle-top10,oracle-top20,oracle-copy-late20 \
        --out results/issue18-s30/probe/hide2.jsonl
"""

import argparse
import json
import math

import torch

import importlib.util
from pathlib import Path

import kvcompress.strategies.importance as imp
from kvcompress.eval.data import Haystack, load_haystack_text
from kvcompress.eval.greedy import greedy
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.reconstruction import copy_for
from kvcompress.hf.loading import load_model
from kvcompress.presets import get_preset

_spec = importlib.util.spec_from_file_location("capture", Path(__file__).resolve().parents[1] / "issue18-s27" / "capture.py")
capture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capture)
PG = capture.PG
# name -> (the needle protected from compression in every head, where it is then hidden: see the docstring)
VARIANTS = {"oracle": (True, None), "oracle-copy-only": (True, "not-copy"), "oracle-no-copy": (True, "copy"),
            "oracle-early": (True, "early"), "oracle-late": (True, "late"), "preset": (False, None),
            "preset-copy-only": (False, "not-copy"), "oracle-copy-layers": (True, "copy-layers"),
            "oracle-top10": (True, "top10"), "oracle-top20": (True, "top20"), "oracle-copy-late20": (True, "copy-late20")}
NEG_INF = float("-inf")


def copy_heads(snap, share):
    """[L, H] bool: the guard's copy heads (its own rule: the top ceil(share * L * H) copy scores)."""
    x = torch.stack([imp.copy_of(st)[0] for st in snap.states]).float()  # [L, H]
    k = int(math.ceil(share * x.numel() - 1e-9))
    return x >= x.flatten().topk(k).values[-1]


def hide(cache, span, where):
    """Give the slots at the span's positions no attention in the (layer, head) pairs ``where`` [L, H] marks."""
    a, b = span
    with torch.inference_mode():  # the cache's tensors are inference tensors
        _hide(cache, a, b, where)


def _hide(cache, a, b, where):
    for i in cache.compressed_layer_ids():
        layer = cache.layers[i]
        pos = layer._pos[:, :, : layer.n]
        inside = (pos >= a) & (pos < b) & where[i].to(pos.device)[None, :, None]
        layer._ls[:, :, : layer.n].masked_fill_(inside, NEG_INF)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depth", type=float, default=0.9)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--preset", default="kvzip-copy-heads-layers-sentences")
    ap.add_argument("--variants", default="oracle,oracle-copy-only,oracle-no-copy,oracle-early,oracle-late,preset,"
                    "preset-copy-only")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    hay = Haystack(*load_haystack_text(PG))
    samples = niah_samples(tok, hay, [a.length], [a.depth], a.samples, kind="number", seed=a.seed)
    cfg = get_preset(a.preset, keep_ratio=0.25)
    share = cfg.guards[0].params["copy_heads"]
    with open(a.out, "w") as f:
        for sample in samples:
            prompt, spans, snap = capture.prefilled(model, tok, sample, cfg)
            needle = spans["needle"]
            L = len(snap.states)
            for name in a.variants.split(","):
                protect, where = VARIANTS[name]
                copy = copy_for(model, tok, snap, cfg, protect=[needle] if protect else ())
                ch = copy_heads(snap, share)
                layer = torch.arange(L)[:, None].expand_as(ch)
                held = {"not-copy": ch, "copy-layers": ch.any(-1, keepdim=True).expand_as(ch),
                        "top10": copy_heads(snap, 0.1), "top20": copy_heads(snap, 0.2),
                        "copy-late20": ch | (layer >= 20)}
                mask = {"copy": ch, "early": layer < L // 2, "late": layer >= L // 2}.get(where)
                if where in held:
                    mask = ~held[where]
                try:
                    if mask is not None:
                        hide(copy.cache, needle, mask)
                    new, _ = greedy(model, copy.cache, prompt.tail, 24)
                finally:
                    copy.cache.close()
                answer = tok.decode(new, skip_special_tokens=True).strip()
                hit = any(x in answer for x in sample.answers)
                row = {"sample_id": sample.sample_id, "variant": name, "hit": hit, "answer": answer,
                       "expected": list(sample.answers), "copy_heads": ch.nonzero().tolist()}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(sample.sample_id, name, hit, repr(answer[-40:]), flush=True)


if __name__ == "__main__":
    main()
