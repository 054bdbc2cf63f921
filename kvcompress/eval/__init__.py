"""Evaluation suite: needle in a haystack, RULER-style tasks, output fidelity, ablations.

    kvcompress eval niah --haystack ../shared/data/paul_graham_essays --lengths 2048,4096 \\
        --depths 0.1,0.3,0.5,0.7,0.9 --presets all --budgets 0.9,0.75,0.5,0.25 --out results/niah
    kvcompress eval ruler --tasks all --lengths 2048 --presets semanticache,centroidkv --out results/ruler
    kvcompress eval fidelity --prefix 1000 --continuation 500 --out results/fidelity
    kvcompress eval niah --ablation chunking --out results/ablation-chunking

Every sample is prefilled once with the full cache (``caches.Recorder``); each method compresses a
copy of that prefill (``caches.compressed_copy``). Cells are appended to ``cells.jsonl`` as they
finish, and a rerun skips them. See docs/results.md.
"""

from .caches import Copy, Recorder, Snapshot, compressed_copy, trace_mark
from .data import NEEDLE_KINDS, Haystack, Needle, insert_at_depth, make_needle
from .fidelity import compare, fidelity_windows, run_fidelity
from .methods import ABLATIONS, Method, parse_methods
from .niah import niah_samples
from .results import CellStore, aggregate, write_results
from .ruler import TASKS, ruler_samples
from .runner import PROTOCOLS, Grid, QASample, run_qa
from .scoring import hit, leading_digits, score, string_match_all, string_match_part

__all__ = [
    "Recorder", "Snapshot", "Copy", "compressed_copy", "trace_mark", "Haystack", "Needle", "NEEDLE_KINDS",
    "insert_at_depth", "make_needle", "compare", "fidelity_windows", "run_fidelity", "ABLATIONS", "Method",
    "parse_methods", "niah_samples", "CellStore", "aggregate", "write_results", "TASKS", "ruler_samples",
    "PROTOCOLS", "Grid", "QASample", "run_qa", "hit", "leading_digits", "score", "string_match_all",
    "string_match_part",
]
