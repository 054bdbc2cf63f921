"""Needle in a haystack: a grid of context lengths x needle depths.

The haystack window of a (length, sample) pair is the same at every depth, so a row of the
heatmap differs only in where the needle sits; each sample draws its own needle value.
"Length" counts the tokens of the context (haystack + needle), not of the chat template or the
question; each record also holds the exact count.
"""

from __future__ import annotations

import random

from ..validation import check_choice, check_int, check_range
from .data import (NEEDLE_KINDS, Haystack, add_distractors, count_tokens, fit_tokens, insert_at_depth, make_needle,
                   sub_span)
from .runner import QASample

# SmolLM2 answers "The special magic number mentioned in the text is 9577766." (18 tokens)
MAX_NEW_TOKENS = {"number": 24, "word": 24, "uuid": 64}


def place_in_haystack(tokenizer, haystack: Haystack, sentence: str, value: str, length: int, depth: float,
                      sample: int, seed: int, distractors: bool = False):
    """(context, spans): ``sentence`` placed at ``depth`` of a haystack window of ~``length`` tokens in
    all; the window depends only on (seed, length, sample), so a heatmap row moves only the sentence.
    With ``distractors``, ordinary sentences with numbers are mixed into the window first.
    spans: {"needle": the sentence's characters, "value": the value's within it}."""
    need = max(length - count_tokens(tokenizer, f" {sentence} "), 1)
    filler = haystack.window(tokenizer, need, random.Random(f"niah-haystack-{seed}-{length}-{sample}"))
    if distractors:
        filler = add_distractors(filler, random.Random(f"distractors-{seed}-{length}-{sample}"))
        filler = fit_tokens(tokenizer, filler, need)
    ctx = insert_at_depth(filler, [("needle", sentence, depth)])
    return ctx, {"needle": ctx.spans["needle"], "value": sub_span(ctx, "needle", value)}


def niah_samples(tokenizer, haystack: Haystack, lengths, depths, samples: int = 1, kind: str = "number",
                 seed: int = 0) -> list[QASample]:
    """One QASample per (length, depth, sample index), in that order."""
    check_choice("needle", kind, NEEDLE_KINDS)
    check_int("samples", samples, 1)
    out = []
    for length in lengths:
        check_int("length", length, 8)
        for s in range(samples):
            for depth in depths:
                check_range("depth", depth, 0.0, 1.0)
                rng = random.Random(f"niah-needle-{seed}-{kind}-{length}-{depth}-{s}")
                needle = make_needle(kind, rng)
                ctx, spans = place_in_haystack(tokenizer, haystack, needle.sentence, needle.value, length, depth, s,
                                               seed)
                out.append(QASample(
                    sample_id=f"niah-{kind}-L{length}-d{depth:g}-s{s}", task=f"niah_{kind}", context=ctx.text,
                    question=needle.question, answers=[needle.value], metric="needle",
                    max_new_tokens=MAX_NEW_TOKENS[kind], spans=spans,
                    meta={"length": length, "depth": depth, "sample": s, "needle": kind, "value": needle.value},
                ))
    return out
