"""Output fidelity: teacher-forced continuation of real text after a compressed prefix.

Per window of real text: ``prefix`` tokens are prefilled once (full cache) and compressed by each
method; the next ``continuation`` tokens are then fed, teacher-forced, over the compressed cache
(in one causal multi-token forward, or chunks of ``chunk`` tokens; no recompression happens while
they are fed) and their next-token distributions are compared with the full cache's:

    kl       mean over positions of KL(full || compressed), in nats
    top1     share of positions where both argmax tokens agree
    ppl      perplexity of the true next tokens (ppl_full for the full cache, ppl_delta the change)
"""

from __future__ import annotations

import math
import random
import time

import torch

from ..validation import check_int, require
from .caches import Recorder
from .reconstruction import copy_for
from .data import Haystack
from .results import CellStore, cell_key
from .runner import Grid, pending_windows, progress_bar, window_records

PROTOCOL = "teacher-forced"


def fidelity_windows(tokenizer, haystack: Haystack, prefix: int, continuation: int, samples: int = 1,
                     seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(sample id, ids [1, prefix + continuation + 1]) per sample, windows starting at sentences."""
    check_int("prefix", prefix, 2)
    check_int("continuation", continuation, 1)
    check_int("samples", samples, 1)
    out = []
    need = prefix + continuation + 1
    for s in range(samples):
        text = haystack.window(tokenizer, need + 16, random.Random(f"fidelity-{seed}-{s}"))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:need]
        require(len(ids) == need, "haystack", haystack.name, f"text of at least {need} tokens")
        out.append((f"fidelity-P{prefix}-C{continuation}-s{s}", torch.tensor([ids])))
    return out


def teacher_forced_logits(model, cache, ids: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """[q, V] float32 logits of ``ids`` [1, q] fed over ``cache`` in chunks."""
    from ..hf.generate import cache_kwarg

    key = cache_kwarg(model)
    step = ids.shape[1] if not chunk else chunk
    parts = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], step):
            out = model(input_ids=ids[:, start:start + step], use_cache=True, **{key: cache})
            parts.append(out.logits[0].float())
    return torch.cat(parts, dim=0)


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """KL(full || compressed), top-1 agreement and perplexities; logits [q, V], targets [q]."""
    ref = torch.log_softmax(ref_logits.double(), dim=-1)
    cmp = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref.exp() * (ref - cmp)).sum(-1)  # [q]
    nll_full = -ref.gather(-1, targets[:, None])[:, 0]
    nll = -cmp.gather(-1, targets[:, None])[:, 0]
    ppl_full, ppl = math.exp(float(nll_full.mean())), math.exp(float(nll.mean()))
    top1 = (ref.argmax(-1) == cmp.argmax(-1)).double().mean()
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(top1),
            "ppl_full": ppl_full, "ppl": ppl, "ppl_delta": ppl - ppl_full, "positions": int(targets.numel())}


def run_fidelity(model, tokenizer, windows, grid: Grid, store: CellStore, *, prefix: int, chunk: int | None = None,
                 backend: str = "auto", progress: bool = True) -> list[dict]:
    """Every pending (window, method, budget) cell; returns the grid's records."""
    cells_of = pending_windows(windows, grid, store, PROTOCOL)
    bar = progress_bar(sum(len(v) for v in cells_of.values()), progress, "fidelity")
    try:
        for sid, ids in windows:
            cells = cells_of[sid]
            if not cells:
                continue
            bar.set_description(sid[:40])
            configs = {(m.label, b): m.config(b) for m, b in cells}
            rec = Recorder.for_configs(model, tokenizer, configs.values(), backend=backend)
            try:
                rec.feed(ids[:, :prefix])
                snap = rec.snapshot()
                cont = ids[:, prefix:-1]  # [1, C]: fed; ids[prefix + 1:] are the targets
                ref_logits = rec.feed(cont, logits=True)[0].float()
            finally:
                rec.close()
            targets = ids[0, prefix + 1:]
            for method, budget in cells:
                copy = copy_for(model, tokenizer, snap, configs[(method.label, budget)])
                copy.cache.enabled = False  # only the prefix is compressed
                start = time.perf_counter()
                try:
                    logits = teacher_forced_logits(model, copy.cache, cont, chunk)
                finally:
                    copy.cache.close()
                seconds = time.perf_counter() - start
                metrics = compare(ref_logits, logits, targets)
                store.add({
                    "key": cell_key(sid, method.label, budget, PROTOCOL), "task": "fidelity", "sample_id": sid,
                    "method": method.label, "preset": method.preset, "overrides": dict(method.overrides),
                    "budget": budget, "protocol": PROTOCOL, "prefix": prefix, "continuation": int(cont.shape[1]),
                    "chunk": chunk, **metrics,
                    "keep_max": round(copy.keep_max, 5), "keep_mean": round(copy.keep_mean, 5),
                    "keep_total": round(copy.keep_total, 5), "budget_met": copy.meets(budget), "layers_met": copy.layers_met,
                    "prefill_s": round(rec.prefill_s, 4), "prefill_forwards": rec.forwards,
                    "compress_s": round(copy.compress_s, 4), "reconstruct_s": round(copy.reconstruct_s, 4),
                    "decode_s": round(seconds, 4),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                })
                bar.update(1)
                bar.set_postfix_str(f"{method.label[:24]}@{budget:g}: KL {metrics['kl']:.3f}")
    finally:
        bar.close()
    return window_records(windows, grid, store, PROTOCOL)
