"""Facts in a haystack, optionally among distractor sentences with ordinary numbers (issue 18).

Like ``niah_samples`` (same grid order, same haystack window at every depth), with the fact
formats of ``data.make_fact`` and, with ``distractors``, an ordinary sentence carrying numbers
(a year, a count, a price) every ~150 tokens, so a signal that keeps "sentences with digits"
cannot find a 7-digit needle by its digits alone.
"""

from __future__ import annotations

import random

from ..validation import check_int, check_range
from .data import FACT_KINDS, Haystack, make_fact
from .niah import place_in_haystack
from .runner import QASample

MAX_NEW_TOKENS = 24


def fact_samples(tokenizer, haystack: Haystack, lengths, depths, samples: int = 1, kind: str = "code-word",
                 distractors: bool = False, seed: int = 0) -> list[QASample]:
    """One QASample per (length, sample, depth); context ~length tokens (haystack, distractors, fact)."""
    check_int("samples", samples, 1)
    out = []
    for length in lengths:
        check_int("length", length, 8)
        for s in range(samples):
            for depth in depths:
                check_range("depth", depth, 0.0, 1.0)
                fact = make_fact(kind, random.Random(f"fact-{seed}-{kind}-{length}-{depth}-{s}"))
                ctx, spans = place_in_haystack(tokenizer, haystack, fact.sentence, fact.value, length, depth, s,
                                               seed, distractors)
                task = f"fact_{kind}" + ("_distractors" if distractors else "")
                out.append(QASample(
                    sample_id=f"{task}-L{length}-d{depth:g}-s{s}", task=task, context=ctx.text,
                    question=fact.question, answers=[fact.value], metric="needle", max_new_tokens=MAX_NEW_TOKENS,
                    spans=spans, meta={"length": length, "depth": depth, "sample": s, "needle": kind,
                                       "distractors": distractors, "value": fact.value},
                ))
    return out


__all__ = ["FACT_KINDS", "fact_samples"]
