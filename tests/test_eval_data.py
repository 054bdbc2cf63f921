"""Evaluation suite, no model: haystacks, needles, RULER samples, scoring, method specs, store."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from kvcompress.eval.data import Haystack, insert_at_depth, load_haystack_text, token_span
from kvcompress.eval.methods import ABLATIONS, Method, parse_methods
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.results import CellStore, aggregate
from kvcompress.eval.ruler import TASKS, ruler_samples
from kvcompress.eval.scoring import hit, leading_digits, score, string_match_all, string_match_part

from test_eval_helpers import TEXT, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------ haystacks and needles
def test_default_haystack_is_pydoc_topics():
    text, name = load_haystack_text(None)
    assert name == "pydoc_data.topics" and len(text) > 100_000


def test_directory_haystack_skips_licence(tmp_path):
    (tmp_path / "b.txt").write_text("Second essay.")
    (tmp_path / "a.txt").write_text("First essay.")
    (tmp_path / "LICENSE.txt").write_text("MIT License")
    text, name = load_haystack_text(tmp_path)
    assert text == "First essay.\n\nSecond essay." and name == tmp_path.name
    with pytest.raises(ValueError, match="haystack"):
        load_haystack_text(tmp_path / "missing")


@pytest.mark.parametrize("length", [60, 150, 400])  # 400 > the text: the window wraps around
def test_window_has_the_token_count_and_starts_at_a_sentence(tok, length):
    hay = Haystack(TEXT[:600], "toy")
    for seed in range(3):
        text = hay.window(tok, length, random.Random(seed))
        assert abs(n_tokens(tok, text) - length) <= 1
        assert text[0].isupper()


@pytest.mark.parametrize("kind", ["number", "word", "uuid"])
def test_niah_needle_at_depth_and_context_length(tok, kind):
    hay = Haystack(TEXT, "toy")
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    samples = niah_samples(tok, hay, [150, 300], depths, samples=2, kind=kind, seed=3)
    assert len(samples) == 2 * 2 * len(depths)
    for s in samples:
        value = s.meta["value"]
        a, b = s.spans["needle"]
        assert s.context[a:b] == f"The special magic {kind} is {value}."
        va, vb = s.spans["value"]
        assert s.context[va:vb] == value and s.answers == [value]
        if kind == "number":
            assert re.fullmatch(r"[1-9]\d{6}", value)
        assert abs(n_tokens(tok, s.context) - s.meta["length"]) <= 3
        # the needle's token position matches the depth (within one sentence of the toy text)
        enc = tok(s.context, add_special_tokens=False, return_offsets_mapping=True)
        first, last = token_span(enc["offset_mapping"], (a, b))
        rel = first / (len(enc["input_ids"]) - (last - first))  # position among the haystack tokens
        assert abs(rel - s.meta["depth"]) <= 0.12, (rel, s.meta)
    # the haystack of a (length, sample) pair is the same at every depth: only the needle moves
    row = [s for s in samples if s.meta["length"] == 150 and s.meta["sample"] == 1]
    bare = {re.sub(r"\s+", " ", s.context.replace(s.context[slice(*s.spans["needle"])], "")).strip() for s in row}
    assert len({t[:200] for t in bare}) == 1
    # deterministic in the seed, different across seeds
    again = niah_samples(tok, hay, [150, 300], depths, samples=2, kind=kind, seed=3)
    assert [s.context for s in again] == [s.context for s in samples]
    other = niah_samples(tok, hay, [150], [0.5], samples=1, kind=kind, seed=4)
    assert other[0].meta["value"] != samples[2].meta["value"] or kind == "word"


def test_insert_at_depth_reports_spans():
    ctx = insert_at_depth("One. Two. Three. Four.", [("a", "Needle A.", 0.5), ("b", "Needle B.", 1.0)])
    for name, sentence in (("a", "Needle A."), ("b", "Needle B.")):
        lo, hi = ctx.spans[name]
        assert ctx.text[lo:hi] == sentence
    assert ctx.text.index("Needle A.") < ctx.text.index("Three")


@pytest.mark.parametrize("task", TASKS)
def test_ruler_samples_hold_their_answers(tok, task):
    hay = Haystack(TEXT, "toy")
    samples = ruler_samples(tok, hay, [task], [300], samples=2, seed=1)
    assert len(samples) == 2
    for s in samples:
        assert abs(n_tokens(tok, s.context) - 300) <= 8, n_tokens(tok, s.context)
        assert s.answers
        if task.startswith("niah") or task == "vt":
            for ans in s.answers:
                assert ans in s.context
            if task.startswith("niah_multi"):
                assert len(s.answers) == 4 or task == "niah_multikey"
            if task == "niah_multikey":
                assert s.context.count("special magic numbers for") == 4
        if task == "vt":
            value = s.question.split("value ")[1].split()[0]
            assert f"VAR {s.answers[0]} = {value}." in s.context
            for prev, nxt in zip(s.answers, s.answers[1:]):
                assert f"VAR {nxt} = VAR {prev}." in s.context
        if task in ("cwe", "fwe"):
            words = re.findall(r"[a-z]+", s.context)
            counts = Counter(words)
            k = len(s.answers)
            top = sorted(counts.values(), reverse=True)
            assert sorted(counts[a] for a in s.answers) == sorted(top[:k])
            assert counts[s.answers[-1]] > top[k] if len(top) > k else True


# ------------------------------------------------------------------------------ scoring
def test_hit_is_exact_for_numbers():
    assert hit("The number is 9577766.", "9577766")
    assert not hit("95777661", "9577766") and not hit("19577766", "9577766")
    assert not hit("957.", "9577766")
    assert hit("It is PANDA", "panda")


@pytest.mark.parametrize("answer,expected", [
    ("957.", 3), ("9577766", 7), ("The number 1234 then 95777", 5), ("none", 0), ("8577766", 0), ("9 5 7", 1),
])
def test_leading_digits(answer, expected):
    assert leading_digits(answer, "9577766") == expected


def test_ruler_metrics_and_score():
    assert string_match_all("apple and Mango", ["apple", "mango", "kiwi"]) == pytest.approx(2 / 3)
    assert string_match_part("apple", ["kiwi", "apple"]) == 1.0
    assert score("x 9577766", ["9577766"], "needle") == {"score": 1.0, "hit": True, "leading_digits": 7}
    assert score("a b", ["a", "c"], "all") == {"score": 0.5, "hit": False}
    with pytest.raises(ValueError, match="metric"):
        score("a", ["a"], "bleu")


# ------------------------------------------------------------------------------ method specs
def test_method_specs_and_labels():
    m = Method.parse("semanticache:clusterer.tau=0.9,proportional_attention=false")
    cfg = m.config(0.5)
    assert cfg.clusterer.params["tau"] == 0.9 and cfg.proportional_attention is False
    assert cfg.keep_ratio == 0.5 and cfg.on_infeasible == "best_effort"
    full = Method.parse("full")
    assert full.is_full and full.budgets((0.5, 0.25)) == (1.0,)
    methods = parse_methods("full,centroidkv", ["centroidkv-chunk16"], {"recent": 8})
    assert [x.label for x in methods] == ["full", "centroidkv:recent=8", "centroidkv-chunk16:recent=8"]
    assert methods[1].config(0.25).recent == 8 and methods[0].config(0.25).keep_ratio == 1.0
    with pytest.raises(ValueError):
        Method.parse("no-such-preset")
    with pytest.raises(ValueError, match="override"):
        parse_methods("semanticache", None, {"nonsense": 1})
    for name, (specs, budgets) in ABLATIONS.items():
        assert len(parse_methods(None, None, None, name)) == len(specs) and budgets


# ------------------------------------------------------------------------------ store
def test_store_resumes_and_refuses_other_settings(tmp_path):
    store = CellStore(tmp_path, {"task": "niah", "seed": 0})
    store.add({"key": "a", "method": "m", "budget": 0.5, "protocol": "agnostic", "score": 1.0, "hit": True,
               "keep_max": 0.5, "budget_met": True})
    with (tmp_path / "cells.jsonl").open("a") as f:
        f.write('{"key": "b", "cut')  # an interrupted write
    again = CellStore(tmp_path, {"task": "niah", "seed": 0})
    assert again.done("a") and not again.done("b")
    with pytest.raises(ValueError, match="seed"):
        CellStore(tmp_path, {"task": "niah", "seed": 1})
    assert json.loads((tmp_path / "run.json").read_text()) == {"task": "niah", "seed": 0}


def test_aggregate_counts_hits_and_budgets():
    recs = [dict(method="m", budget=0.5, protocol="p", score=s, hit=s == 1.0, leading_digits=d, keep_max=k,
                 keep_mean=k, budget_met=k <= 0.5) for s, d, k in ((1.0, 7, 0.5), (0.0, 3, 0.6))]
    (row,) = aggregate(recs)
    assert row["n"] == 2 and row["hits"] == 1 and row["accuracy"] == 0.5 and row["leading_digits"] == 5
    assert row["keep_max"] == 0.6 and row["budget_met"] is False and row["budget_met_share"] == 0.5
