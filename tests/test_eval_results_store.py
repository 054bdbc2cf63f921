"""cells.jsonl survives crashes: a last line cut off mid-write is dropped before the next record
is appended (so every later line is valid JSON and the cell is not recomputed forever), a whole
last record lacking only its newline is kept; sample fields never replace the runner's own."""

from __future__ import annotations

import json

from kvcompress.eval.results import CellStore
from kvcompress.eval.runner import with_sample_meta


def _lines(path):
    return path.read_text().splitlines()


def test_a_cut_off_last_line_is_dropped_and_the_next_record_starts_clean(tmp_path):
    store = CellStore(tmp_path, {"task": "t"})
    store.add({"key": "a", "score": 1})
    store.add({"key": "b", "score": 0})
    with store.path.open("a") as f:
        f.write('{"key": "c", "sco')  # a crash mid-write
    again = CellStore(tmp_path, {"task": "t"})
    assert set(again.records) == {"a", "b"}
    again.add({"key": "c", "score": 1})
    lines = _lines(store.path)
    assert [json.loads(line)["key"] for line in lines] == ["a", "b", "c"]  # every line parses
    third = CellStore(tmp_path, {"task": "t"})
    assert set(third.records) == {"a", "b", "c"}


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    store = CellStore(tmp_path, {"task": "t"})
    store.add({"key": "a"})
    with store.path.open("a") as f:
        f.write('{"key": "b"}')
    again = CellStore(tmp_path, {"task": "t"})
    assert set(again.records) == {"a", "b"}
    again.add({"key": "c"})
    assert [json.loads(line)["key"] for line in _lines(store.path)] == ["a", "b", "c"]


def test_a_file_that_is_only_a_fragment_is_emptied(tmp_path):
    (tmp_path / "cells.jsonl").write_text('{"key": "a", ')
    store = CellStore(tmp_path, {"task": "t"})
    assert store.records == {}
    store.add({"key": "a"})
    assert _lines(store.path) == ['{"key": "a"}']


def test_a_record_that_cannot_be_serialised_writes_nothing(tmp_path):
    store = CellStore(tmp_path, {"task": "t"})
    store.add({"key": "a"})
    try:
        store.add({"key": "b", "bad": object()})
    except TypeError:
        pass
    assert _lines(store.path) == ['{"key": "a"}'] and "b" not in store.records


def test_sample_fields_never_replace_the_runners():
    record = {"key": "s|m|0.5|agnostic", "budget": 0.5, "answer": "x"}
    out = with_sample_meta(record, {"key": "mine", "length": 100, "budget": "sample's"})
    assert out["key"] == "s|m|0.5|agnostic" and out["budget"] == 0.5 and out["length"] == 100
    assert out["sample_meta"] == {"key": "mine", "budget": "sample's"}
    assert "sample_meta" not in with_sample_meta(record, {"depth": 0.5})
