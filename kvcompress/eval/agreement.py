"""Generation agreement: greedy text after an instruction over the compressed context vs the full cache.

Per window of real text (starting at a sentence), the chat prompt is the window followed by an
instruction (default: a summary request); the context part is prefilled once and compressed by
each method (query-agnostic: the instruction is fed after compression, uncompressed), then
``new_tokens`` tokens are generated greedily. Against the full cache's own greedy output F
(length N, stopping tokens excluded) a method's output C scores:

    lead   the number of leading tokens identical to F (how long it stays on the full cache's path)
    lcs    longest common subsequence of C and F, divided by N (order-preserving overlap)

Greedy text diverges for good at its first differing token, so after it ``lcs`` compares two
unrelated continuations and is noisy window to window. The same cells therefore also read the
method on the full cache's own path: the instruction and F teacher-forced over the compressed
context (compressed once; nothing of the path is compressed, as in fidelity), against the full cache's logits on the same N + 1 positions (the first predicts F[0], the
last what follows F):

    forced_kl    mean KL(full || compressed) over those positions, in nats
    forced_top1  share of them whose argmax equals the full cache's
    forced_lead  leading positions whose argmax equals the full cache's (``lead`` without the
                 greedy divergence; equal to it unless a tie in the logits flips a token)
"""

from __future__ import annotations

import random
import time

import torch

from ..validation import check_int, require
from .caches import Recorder, compressed_copy
from .data import Haystack
from .fidelity import teacher_forced_logits, compare
from .greedy import build_prompt, greedy, stop_ids
from .methods import Method
from .reconstruction import copy_for
from .results import CellStore, cell_key
from .runner import Grid, pending_windows, progress_bar, window_records

PROTOCOL = "agnostic"
INSTRUCTION = "Summarize the text above."


def lcs_length(a: list, b: list) -> int:
    """Length of the longest common subsequence of two token lists (O(len(a) * len(b)), tiny lists)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def leading_match(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(reference: list, tokens: list) -> dict:
    """lead and lcs (/ len(reference)) of ``tokens`` against ``reference``."""
    n = max(len(reference), 1)
    return {"lead": leading_match(reference, tokens), "lcs": lcs_length(reference, tokens) / n,
            "ref_tokens": len(reference), "new_tokens": len(tokens)}


def forced_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict:
    """forced_kl / forced_top1 / forced_lead of ``logits`` against ``ref_logits`` (both [q, V], the
    positions of the full cache's answer path)."""
    target = ref_logits.argmax(-1)
    same = logits.argmax(-1) == target
    metrics = compare(ref_logits, logits, target)
    return {"forced_kl": metrics["kl"], "forced_top1": metrics["top1"],
            "forced_lead": int(same.long().cumprod(0).sum())}


def answer_path_logits(model, cache, prompt, answer: list) -> torch.Tensor:
    """[len(answer) + 1, V]: the logits after the prompt's last token and after each answer token,
    with the prompt's tail and ``answer`` teacher-forced over ``cache`` in one forward."""
    tail = prompt.tail
    ids = torch.cat([tail, torch.tensor([answer], dtype=tail.dtype, device=tail.device)], dim=1)
    return teacher_forced_logits(model, cache, ids, None)[tail.shape[1] - 1:]


def agreement_windows(tokenizer, haystack: Haystack, length: int, samples: int, seed: int = 0) -> list:
    """(sample id, context text of ~length tokens) per sample."""
    check_int("length", length, 8)
    check_int("samples", samples, 1)
    return [(f"agree-L{length}-s{s}", haystack.window(tokenizer, length, random.Random(f"agreement-{seed}-{length}-{s}")))
            for s in range(samples)]


def run_agreement(model, tokenizer, windows, grid: Grid, store: CellStore, *, new_tokens: int = 64,
                  instruction: str = INSTRUCTION, chat: bool | None = None, backend: str = "auto",
                  progress: bool = True) -> list[dict]:
    """Every pending (window, method, budget) cell; the full cache's output is the reference."""
    check_int("new_tokens", new_tokens, 1)
    require(isinstance(instruction, str) and instruction.strip() != "", "instruction", instruction,
            "a non-empty instruction")
    stop = stop_ids(tokenizer)
    full = Method.parse("full")
    cells_of = pending_windows(windows, grid, store, PROTOCOL)
    bar = progress_bar(sum(len(v) for v in cells_of.values()), progress, "agreement")
    try:
        for sid, text in windows:
            cells = cells_of[sid]
            if not cells:
                continue
            bar.set_description(sid[:40])
            prompt = build_prompt(tokenizer, text, instruction, chat)
            configs = {(m.label, b): m.config(b) for m, b in cells}
            rec = Recorder.for_configs(model, tokenizer, configs.values(), backend=backend)
            try:
                rec.feed(prompt.head)
                snap = rec.snapshot()
            finally:
                rec.close()
            ref_copy = compressed_copy(model, snap, full.config(1.0))
            try:
                reference, _ = greedy(model, ref_copy.cache, prompt.tail, new_tokens, stop)
            finally:
                ref_copy.cache.close()
            ref_copy = compressed_copy(model, snap, full.config(1.0))
            try:
                ref_logits = answer_path_logits(model, ref_copy.cache, prompt, reference)
            finally:
                ref_copy.cache.close()
            for method, budget in cells:
                config = configs[(method.label, budget)]
                copy = copy_for(model, tokenizer, snap, config)
                try:
                    tokens, decode_s = greedy(model, copy.cache, prompt.tail, new_tokens, stop)
                finally:
                    copy.cache.close()
                forced = copy_for(model, tokenizer, snap, config)  # a fresh copy: greedy has grown the first
                forced.cache.enabled = False  # the context compressed once, the answer path exact (as fidelity)
                try:
                    metrics = {**agreement(reference, tokens),
                               **forced_agreement(ref_logits, answer_path_logits(model, forced.cache, prompt, reference))}
                finally:
                    forced.cache.close()
                store.add({
                    "key": cell_key(sid, method.label, budget, PROTOCOL), "task": "agreement", "sample_id": sid,
                    "method": method.label, "preset": method.preset, "overrides": dict(method.overrides),
                    "budget": budget, "protocol": PROTOCOL, "instruction": instruction, **metrics,
                    "answer": tokenizer.decode(tokens, skip_special_tokens=True),
                    "reference": tokenizer.decode(reference, skip_special_tokens=True),
                    "context_tokens": int(prompt.head.shape[1]),
                    "keep_max": round(copy.keep_max, 5), "keep_mean": round(copy.keep_mean, 5),
                    "keep_total": round(copy.keep_total, 5), "budget_met": copy.meets(budget), "layers_met": copy.layers_met,
                    "prefill_s": round(rec.prefill_s, 4), "compress_s": round(copy.compress_s, 4),
                    "reconstruct_s": round(copy.reconstruct_s, 4), "decode_s": round(decode_s, 4),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                })
                bar.update(1)
                bar.set_postfix_str(f"{method.label[:24]}@{budget:g}: lcs {metrics['lcs']:.2f}")
    finally:
        bar.close()
    return window_records(windows, grid, store, PROTOCOL)
