"""The question-answering grid: samples x methods x budgets x protocols, one prefill per sample.

Protocols:
- "agnostic": the context is compressed; the question (and the chat template's assistant
  preamble) is fed afterwards, uncompressed, over the compressed cache;
- "aware": the whole prompt but its last token is compressed (the question included); the last
  token is fed over the compressed cache. Every answer token sees only compressed slots.

Per sample the model prefills the context once (query-aware continues the same prefill with the
question), whatever the number of methods; each method compresses its own copy of that prefill.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field

from ..validation import check_choice, require
from .caches import Recorder
from .data import token_span
from .greedy import build_prompt, greedy, stop_ids
from .methods import Method
from .reconstruction import copy_for
from .results import CellStore, cell_key
from .scoring import score

PROTOCOLS = ("agnostic", "aware")


@dataclass
class QASample:
    """One prompt to answer.

    answers: expected items; metric: "needle" (every item as a hit), "all" (share of items
    found, RULER's string_match_all) or "part"; spans: name -> (start, end) chars of the context
    to trace through compression ("needle", "value", ...); meta: grid coordinates (length, depth...)
    """

    sample_id: str
    task: str
    context: str
    question: str
    answers: list
    metric: str = "needle"
    max_new_tokens: int = 16
    spans: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


@dataclass
class Grid:
    methods: list
    budgets: tuple
    protocols: tuple = ("agnostic",)

    def __post_init__(self):
        require(bool(self.methods), "methods", self.methods, "at least one method")
        for p in self.protocols:
            check_choice("protocol", p, PROTOCOLS)

    def cells(self):
        """(method, budget, protocol) in run order."""
        for protocol in self.protocols:
            for method in self.methods:
                for budget in method.budgets(self.budgets):
                    yield method, budget, protocol


def progress_bar(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="cell", file=sys.stderr, dynamic_ncols=True)


def run_qa(model, tokenizer, samples: list, grid: Grid, store: CellStore, *, chat: bool | None = None,
           backend: str = "auto", protect: str | None = None, progress: bool = True,
           max_new_tokens: int | None = None) -> list[dict]:
    """Run every pending cell; returns the records of the whole grid (old ones included).

    protect: name of a sample span to protect from merging and eviction in every layer and head
             (an oracle, e.g. "needle"); None protects nothing
    """
    pending = pending_cells(samples, grid, store)
    total = sum(len(v) for v in pending.values())
    stop = stop_ids(tokenizer)
    bar = progress_bar(total, progress, "eval")
    try:
        for sample in samples:
            cells = pending[sample.sample_id]
            if cells:
                bar.set_description(sample.sample_id[:40])
                _run_sample(model, tokenizer, sample, cells, store, chat=chat, backend=backend, protect=protect,
                            stop=stop, bar=bar, max_new_tokens=max_new_tokens or sample.max_new_tokens)
    finally:
        bar.close()
    keys = [cell_key(s.sample_id, m.label, b, p) for s in samples for m, b, p in grid.cells()]
    return [store.records[k] for k in keys if k in store.records]


def pending_cells(samples: list, grid: Grid, store: CellStore) -> dict:
    """{sample id: [(method, budget, protocol), ...]} of the cells still to run."""
    return {s.sample_id: [c for c in grid.cells() if not _finished(store, s, c)] for s in samples}


def pending_windows(windows, grid: Grid, store: CellStore, protocol: str) -> dict:
    """{window id: [(method, budget), ...]} of the cells still to run, for the window tasks
    (fidelity, agreement: one protocol, windows as (id, data) pairs)."""
    return {sid: [(m, b) for m, b, _ in grid.cells() if not store.done(cell_key(sid, m.label, b, protocol))]
            for sid, _ in windows}


def window_records(windows, grid: Grid, store: CellStore, protocol: str) -> list[dict]:
    """The stored records of a window task's grid, in grid order."""
    keys = [cell_key(sid, m.label, b, protocol) for sid, _ in windows for m, b, _ in grid.cells()]
    return [store.records[k] for k in keys if k in store.records]


def prompt_hash(sample: QASample) -> str:
    """A short hash of what the model reads, so a cell computed for another prompt (the
    generator changed) under the same sample id is run again rather than reused."""
    return hashlib.sha1(f"{sample.context}\x00{sample.question}".encode()).hexdigest()[:12]


def _finished(store: CellStore, sample: QASample, cell) -> bool:
    method, budget, protocol = cell
    record = store.records.get(cell_key(sample.sample_id, method.label, budget, protocol))
    return record is not None and record.get("prompt_sha", prompt_hash(sample)) == prompt_hash(sample)


def _run_sample(model, tokenizer, sample: QASample, cells, store, *, chat, backend, protect, stop, bar,
                max_new_tokens) -> None:
    prompt = build_prompt(tokenizer, sample.context, sample.question, chat)
    spans = {name: token_span(prompt.offsets, span, shift=prompt.context_offset)
             for name, span in sample.spans.items()}
    require(protect is None or protect in spans, "protect", protect, f"a span of the sample: {sorted(spans)}")
    context_tokens = count_context_tokens(prompt)
    configs = {(m.label, b): m.config(b) for m, b, _ in cells}
    protocols = {p for _, _, p in cells}

    rec = Recorder.for_configs(model, tokenizer, configs.values(), backend=backend)
    snaps = {}
    try:
        rec.feed(prompt.head)
        if "agnostic" in protocols:
            snaps["agnostic"] = rec.snapshot()
        if "aware" in protocols:
            if prompt.tail.shape[1] > 1:
                rec.feed(prompt.tail[:, :-1])
            snaps["aware"] = rec.snapshot()
    finally:
        rec.close()
    prefill_s, forwards = rec.prefill_s, rec.forwards

    for method, budget, protocol in cells:
        snap = snaps[protocol]
        cfg = configs[(method.label, budget)]
        copy = copy_for(model, tokenizer, snap, cfg, protect=[spans[protect]] if protect else (),
                        marks=spans)
        first = prompt.tail if protocol == "agnostic" else prompt.aware_last()
        try:
            new, decode_s = greedy(model, copy.cache, first, max_new_tokens, stop)
        finally:
            copy.cache.close()
        answer = tokenizer.decode(new, skip_special_tokens=True).strip()
        scores = score(answer, list(sample.answers), sample.metric)
        record = {
            "key": cell_key(sample.sample_id, method.label, budget, protocol),
            "task": sample.task, "sample_id": sample.sample_id, "method": method.label, "preset": method.preset,
            "overrides": dict(method.overrides), "budget": budget, "protocol": protocol,
            "context_tokens": context_tokens, "compressed_tokens": snap.num_tokens,
            "expected": list(sample.answers), "answer": answer, **scores, "prompt_sha": prompt_hash(sample),
            "keep_max": round(copy.keep_max, 5), "keep_mean": round(copy.keep_mean, 5),
            "keep_total": round(copy.keep_total, 5), "budget_met": copy.meets(budget), "layers_met": copy.layers_met,
            "protected": protect, "trace": copy.trace,
            "prefill_s": round(prefill_s, 4), "prefill_forwards": forwards,
            "compress_s": round(copy.compress_s, 4), "reconstruct_s": round(copy.reconstruct_s, 4), "decode_s": round(decode_s, 4), "new_tokens": len(new),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        store.add(with_sample_meta(record, sample.meta))
        bar.update(1)
        bar.set_postfix_str(f"{method.label[:24]}@{budget:g}/{protocol}: {'hit' if scores['hit'] else 'miss'}")


def with_sample_meta(record: dict, meta: dict) -> dict:
    """The record with the sample's grid coordinates (length, depth, ...) added; a sample field
    named like one of the runner's (``key``, ``budget``, ...) never replaces it: it is kept under
    ``sample_meta``."""
    clash = {k: v for k, v in meta.items() if k in record}
    out = {**{k: v for k, v in meta.items() if k not in record}, **record}
    if clash:
        out["sample_meta"] = clash
    return out


def count_context_tokens(prompt) -> int:
    """Head tokens whose characters lie inside the context."""
    start = prompt.context_offset
    return sum(1 for s, e in prompt.offsets if s >= start and e > s)


def describe_methods(methods: list[Method]) -> list[dict]:
    return [{"label": m.label, "preset": m.preset, "overrides": dict(m.overrides)} for m in methods]
