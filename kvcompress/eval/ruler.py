"""RULER-style synthetic tasks, generated locally (after Hsieh et al., "RULER: What's the Real
Context Size of Your Long-Context Language Models?", 2024).

    niah_single_number / _word / _uuid  one keyed needle in the haystack
    niah_multikey     four keyed numbers, one asked (the other three distract)
    niah_multivalue   four numbers under one key, all asked
    niah_multiquery   four keys, all asked
    vt                variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... in noise text;
                      name every variable holding the value
    cwe               common words extraction: the 10 most frequent words of a numbered list
    fwe               frequent words extraction: the 3 most frequent coded words of a Zipf text

Scoring as in RULER: string_match_all, the share of expected items found in the answer
(case-insensitive); a sample's "hit" is all of them found.
"""

from __future__ import annotations

import random

from ..validation import check_choice, check_int, require
from .data import NOISE, WORDS, Haystack, count_tokens, fit_tokens, insert_at_depth, random_value, random_word
from .runner import QASample

TASKS = ("niah_single_number", "niah_single_word", "niah_single_uuid", "niah_multikey", "niah_multivalue",
         "niah_multiquery", "vt", "cwe", "fwe")
# answers repeat the question first ("The special magic number for X mentioned in the text is ...")
MAX_NEW_TOKENS = {"niah_single_number": 32, "niah_single_word": 32, "niah_single_uuid": 64, "niah_multikey": 32,
                  "niah_multivalue": 80, "niah_multiquery": 80, "vt": 48, "cwe": 96, "fwe": 40}
NEEDLES = 4  # needles of the multi-* tasks


def _key(rng: random.Random, used: set) -> str:
    while True:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if key not in used:
            used.add(key)
            return key


def _keyed(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind}s for {key} is: {value}."


def _niah(tokenizer, haystack: Haystack, task: str, length: int, rng: random.Random) -> dict:
    kind = {"niah_single_word": "word", "niah_single_uuid": "uuid"}.get(task, "number")
    used_keys: set = set()
    used_values: set = set()
    count = 1 if task.startswith("niah_single") else NEEDLES
    shared_key = _key(rng, used_keys) if task == "niah_multivalue" else None
    facts = []
    for _ in range(count):
        value = random_value(kind, rng, used_values)
        used_values.add(value)
        facts.append((shared_key or _key(rng, used_keys), value))
    sentences = [_keyed(kind, k, v) for k, v in facts]
    needle_tokens = sum(count_tokens(tokenizer, f" {s} ") for s in sentences)
    filler = haystack.window(tokenizer, max(length - needle_tokens, 1), rng)
    depths = sorted(rng.random() for _ in sentences)
    order = list(range(len(sentences)))
    rng.shuffle(order)  # the asked needle is not always the first one
    pieces = [(f"needle{i}", sentences[i], depths[j]) for j, i in enumerate(order)]
    ctx = insert_at_depth(filler, pieces)
    if task == "niah_multivalue":
        question = f"What are all the special magic {kind}s for {facts[0][0]} mentioned in the provided text?"
        answers = [v for _, v in facts]
    elif task == "niah_multiquery":
        keys = [k for k, _ in facts]
        question = (f"What are all the special magic {kind}s for {', '.join(keys[:-1])}, and {keys[-1]} "
                    f"mentioned in the provided text?")
        answers = [v for _, v in facts]
    else:
        question = f"What is the special magic {kind} for {facts[0][0]} mentioned in the provided text?"
        answers = [facts[0][1]]
    return {"context": ctx.text, "question": question, "answers": answers, "spans": ctx.spans,
            "depths": [round(depths[order.index(i)], 3) for i in range(len(sentences))]}


def _vt(tokenizer, length: int, rng: random.Random, hops: int = 4) -> dict:
    value = str(rng.randint(10000, 99999))
    names: list = []
    while len(names) < hops + 1:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    sentences = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    chain_tokens = sum(count_tokens(tokenizer, f" {s} ") for s in sentences)
    noise = Haystack(NOISE * 8, "noise")
    filler = noise.window(tokenizer, max(length - chain_tokens, 1), None)
    depths = sorted(rng.random() for _ in sentences)
    ctx = insert_at_depth(filler, [(f"var{i}", s, d) for i, (s, d) in enumerate(zip(sentences, depths))])
    question = f"Find all variables that are assigned the value {value} in the text above."
    return {"context": ctx.text, "question": question,
            "answers": names, "spans": ctx.spans, "depths": [round(d, 3) for d in depths]}


def _numbered(words: list) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe(tokenizer, length: int, rng: random.Random, num_common: int = 10) -> dict:
    pool = list(WORDS)
    rng.shuffle(pool)
    common, rest = pool[:num_common], pool[num_common:]
    per_entry = max(1.0, count_tokens(tokenizer, _numbered(rest[:50])) / 50)
    entries = int(length / per_entry)
    freq_common = max(4, min(30, entries // (2 * num_common)))
    freq_rare = 3 if freq_common > 3 else 1
    n_rare = max(0, (entries - freq_common * num_common) // freq_rare)
    while len(rest) < n_rare:
        rest.append(random_word(rng, 5, 8))
    words = common * freq_common + rest[:n_rare] * freq_rare
    rng.shuffle(words)
    text = fit_tokens(tokenizer, _numbered(words), length)
    return {"context": text, "question": f"What are the {num_common} most common words in the above list?",
            "answers": common, "spans": {}, "depths": []}


def _fwe(tokenizer, length: int, rng: random.Random, alpha: float = 2.0, top: int = 3) -> dict:
    vocab: list = []
    while len(vocab) < 400:
        w = random_word(rng, 3, 6)
        if w not in vocab:
            vocab.append(w)
    per_word = max(1.0, count_tokens(tokenizer, " ".join(vocab[:100])) / 100)
    n = int(length / per_word)
    harmonic = sum(k ** -alpha for k in range(1, len(vocab) + 1))
    words = []
    for k, w in enumerate(vocab, start=1):
        words += [w] * round(n * k ** -alpha / harmonic)  # the Zipf tail ends where counts round to 0
    rng.shuffle(words)
    text = fit_tokens(tokenizer, " ".join(words), length)
    counts = {w: text.split().count(w) for w in vocab[: top + 3]}
    answers = sorted(counts, key=lambda w: -counts[w])[:top]
    return {"context": text,
            "question": f"What are the {top} most frequently appeared coded words in the above coded text?",
            "answers": answers, "spans": {}, "depths": []}


def ruler_samples(tokenizer, haystack: Haystack, tasks, lengths, samples: int = 1, seed: int = 0) -> list[QASample]:
    """One QASample per (task, length, sample index)."""
    check_int("samples", samples, 1)
    out = []
    for task in tasks:
        check_choice("task", task, TASKS)
        for length in lengths:
            check_int("length", length, 64)
            for s in range(samples):
                rng = random.Random(f"ruler-{seed}-{task}-{length}-{s}")
                if task.startswith("niah"):
                    spec = _niah(tokenizer, haystack, task, length, rng)
                elif task == "vt":
                    spec = _vt(tokenizer, length, rng)
                elif task == "cwe":
                    spec = _cwe(tokenizer, length, rng)
                else:
                    spec = _fwe(tokenizer, length, rng)
                require(len(spec["answers"]) >= 1, "task", task, "a task with an answer")
                out.append(QASample(
                    sample_id=f"ruler-{task}-L{length}-s{s}", task=task, context=spec["context"],
                    question=spec["question"], answers=spec["answers"], metric="all",
                    max_new_tokens=MAX_NEW_TOKENS[task], spans=spec["spans"],
                    meta={"length": length, "sample": s, "depths": spec["depths"]},
                ))
    return out
