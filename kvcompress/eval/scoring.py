"""Scoring of generated answers.

- ``hit``: the expected value appears in the answer (numbers: as a whole digit run, so 95777661
  is not a hit for 9577766; words and UUIDs: case-insensitive substring).
- ``leading_digits``: how many leading digits of the expected number the answer got right: the
  longest common prefix with any digit run of the answer ("957." for 9577766 scores 3).
- ``string_match_all`` / ``string_match_part``: RULER's metrics, the share of expected items found
  in the answer (case-insensitive) and whether any of them is.
"""

from __future__ import annotations

import re

_DIGIT_RUN = re.compile(r"\d+")


def hit(answer: str, expected: str) -> bool:
    if expected.isdigit():
        return re.search(rf"(?<!\d){re.escape(expected)}(?!\d)", answer) is not None
    return expected.lower() in answer.lower()


def leading_digits(answer: str, expected: str) -> int:
    """Longest common prefix of ``expected`` with a digit run of ``answer`` (0 when none)."""
    best = 0
    for run in _DIGIT_RUN.findall(answer):
        n = 0
        for a, b in zip(run, expected):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def string_match_all(answer: str, expected: list[str]) -> float:
    """Share of expected items found in the answer (RULER's string_match_all for one sample)."""
    if not expected:
        return 0.0
    low = answer.lower()
    return sum(e.lower() in low for e in expected) / len(expected)


def string_match_part(answer: str, expected: list[str]) -> float:
    """1.0 when any expected item is in the answer (RULER's string_match_part for one sample)."""
    low = answer.lower()
    return float(any(e.lower() in low for e in expected))


def score(answer: str, expected: list[str], metric: str) -> dict:
    """Scores of one answer: "score" in [0, 1] and "hit" (all items found), plus leading digits
    for single-number answers."""
    if metric == "all":
        s = string_match_all(answer, expected)
    elif metric == "part":
        s = string_match_part(answer, expected)
    elif metric == "needle":
        s = float(all(hit(answer, e) for e in expected))
    else:
        raise ValueError(f"metric={metric!r} is invalid: expected 'all', 'part' or 'needle'")
    out = {"score": s, "hit": s >= 1.0}
    if len(expected) == 1 and expected[0].isdigit():
        out["leading_digits"] = leading_digits(answer, expected[0])
    return out
