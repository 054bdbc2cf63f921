"""Haystacks, needles and contexts of an exact token length.

A haystack is plain text: every ``*.txt`` of a directory (sorted, licence files skipped) or, by
default, the help topics of Python's ``pydoc_data.topics`` (always installed, no download).
``Haystack.window`` cuts a run of whole tokens out of it, starting at a sentence, wrapping around
when the text is too short; ``insert_at_depth`` puts a needle sentence at a sentence boundary near
a fractional depth, and reports where the needle's characters are, so token spans can be found.
"""

from __future__ import annotations

import bisect
import random
import re
import string
import uuid as _uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..validation import check_choice, check_int, check_range, require

NEEDLE_KINDS = ("number", "word", "uuid")

# needle values of kind "word" and keys of keyed needles: common, single-token-ish English words
WORDS = tuple("""
apple anchor arrow autumn badge bamboo banner basket beacon bicycle blanket blossom bottle breeze
bridge bucket butter cabin camera candle canyon carpet castle cedar cherry chimney circle cliff
clover cobalt comet copper coral cotton cradle crystal dagger desert diamond dolphin dragon drum
eagle ember engine falcon feather fiddle forest fossil fountain garden garlic ginger glacier
goblet granite guitar hammer harbor harvest helmet honey horizon island ivory jacket jasmine
jungle kettle kitten ladder lagoon lantern lemon lily lizard magnet mango maple marble meadow
mirror monkey mountain nectar needle nutmeg ocean olive orchid otter oyster paddle palace panda
parrot pebble pepper piano pillow pirate planet pocket pumpkin puzzle quartz quiver rabbit radar
raven ribbon river rocket saddle salmon sapphire scarf shadow silver spider spiral sponge squirrel
statue summit sunset swallow teapot temple thunder tiger timber tomato tornado tower trumpet
tulip tunnel turtle valley velvet violin volcano wagon walnut whistle willow window winter wizard
wolf zebra
""".split())

# RULER's noise haystack (used by variable tracking)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class Needle:
    """A fact hidden in a haystack.

    kind:     "number" (7 digits), "word" or "uuid"
    value:    the expected answer text
    sentence: the text inserted into the haystack
    question: what the model is asked
    """

    kind: str
    value: str
    sentence: str
    question: str


def random_value(kind: str, rng: random.Random, exclude: set | None = None) -> str:
    """A needle value of ``kind``: 7 digits (no leading 0), a word from WORDS, or a UUID."""
    check_choice("needle kind", kind, NEEDLE_KINDS)
    for _ in range(1000):
        if kind == "number":
            value = str(rng.randint(1_000_000, 9_999_999))
        elif kind == "word":
            value = rng.choice(WORDS)
        else:
            value = str(_uuid.UUID(int=rng.getrandbits(128), version=4))
        if not exclude or value not in exclude:
            return value
    raise ValueError(f"needle kind={kind!r} is invalid here: expected a kind with enough distinct values")


def make_needle(kind: str, rng: random.Random) -> Needle:
    """The reference NIAH needle: "The special magic number is 9577766." and its question."""
    value = random_value(kind, rng)
    return Needle(kind=kind, value=value, sentence=f"The special magic {kind} is {value}.",
                  question=f"What is the special magic {kind} mentioned in the text?")


# ---------------------------------------------------------------------------- haystack text
def load_haystack_text(source: str | Path | None = None) -> tuple[str, str]:
    """(text, name). ``source``: a directory of .txt files, one text file, or None for Python's
    pydoc_data.topics. Relative paths resolve against the current working directory."""
    if source is None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key].strip() for key in sorted(topics))
        return text, "pydoc_data.topics"
    path = Path(source).expanduser().resolve()
    require(path.exists(), "haystack", str(source), "an existing directory of .txt files or a text file")
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace"), path.name
    files = sorted(p for p in path.glob("*.txt") if not p.name.upper().startswith("LICENSE"))
    require(bool(files), "haystack", str(source), "a directory holding at least one .txt file")
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in files)
    return text, path.name


# a sentence ends at . ! ? (closing quotes/brackets included) before white space, or at a blank
# line; single newlines are not boundaries (essays are hard-wrapped mid-sentence)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+|\n\s*\n\s*")


class Haystack:
    """Text tokenised once per tokenizer, cut into windows of exact token counts."""

    def __init__(self, text: str, name: str = "text"):
        require(isinstance(text, str) and len(text.strip()) > 0, "haystack", text[:40], "non-empty text")
        self.text = text
        self.name = name
        self._tokenized: dict[int, tuple] = {}
        self._base: dict[int, int] = {}

    @classmethod
    def load(cls, source: str | Path | None = None) -> "Haystack":
        return cls(*load_haystack_text(source))

    def _tokens(self, tokenizer, n_tokens: int) -> tuple[str, list[int], int]:
        """(text, token start offsets, token count) of the text repeated until a window of
        ``n_tokens`` fits after any start inside the first copy."""
        key = id(tokenizer)
        if key not in self._base:
            self._base[key] = len(_token_starts(tokenizer, self.text))
        need = self._base[key] + n_tokens + 2
        cached = self._tokenized.get(key)
        if cached is not None and cached[2] >= need:
            return cached
        text = self.text
        while True:
            starts = _token_starts(tokenizer, text)
            if len(starts) >= need:
                break
            text = text + "\n\n" + self.text
        self._tokenized[key] = (text, starts, len(starts))
        return self._tokenized[key]

    def window(self, tokenizer, n_tokens: int, rng: random.Random | None = None) -> str:
        """About ``n_tokens`` tokens of text starting at a sentence (at the start for rng=None).
        The start depends only on the rng's state, not on ``n_tokens``."""
        check_int("n_tokens", n_tokens, 1)
        text, starts, total = self._tokens(tokenizer, n_tokens)
        first = 0
        if rng is not None:
            match = _SENTENCE_END.search(text, int(rng.random() * len(self.text)))
            if match is not None:
                first = bisect.bisect_left(starts, match.end())
        first = min(first, total - n_tokens - 1)
        lo = starts[first]
        hi = starts[first + n_tokens] if first + n_tokens < total else len(text)
        return text[lo:hi].strip()


def _token_starts(tokenizer, text: str) -> list[int]:
    """Character offset where each token of ``text`` starts."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(a) for a, _ in enc["offset_mapping"]]


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_tokens(tokenizer, text: str, n_tokens: int) -> str:
    """The longest prefix of ``text`` made of whole tokens with at most ``n_tokens`` tokens."""
    check_int("n_tokens", n_tokens, 0)
    starts = _token_starts(tokenizer, text)
    if len(starts) <= n_tokens:
        return text
    return text[: starts[n_tokens]].rstrip()


# ---------------------------------------------------------------------------- needle insertion
@dataclass
class Context:
    """A haystack with needles inserted.

    text:  the context
    spans: name -> (char_start, char_end) of inserted pieces (e.g. "needle", "value")
    """

    text: str
    spans: dict = field(default_factory=dict)


def sentence_boundary(text: str, pos: int) -> int:
    """The sentence boundary (a char index just after ". ", "!", "?" or a newline) nearest to ``pos``
    at or before it, else the nearest after it, else ``pos``."""
    if pos <= 0 or pos >= len(text):
        return min(max(pos, 0), len(text))
    best_before, best_after = None, None
    for m in _SENTENCE_END.finditer(text):
        if m.end() <= pos:
            best_before = m.end()
        else:
            best_after = m.end()
            break
    if best_before is not None:
        return best_before
    return pos if best_after is None else best_after


def insert_at_depth(haystack: str, pieces: list[tuple[str, str, float]]) -> Context:
    """Insert sentences at fractional depths of ``haystack`` (by characters, snapped to sentence
    boundaries). pieces: (name, sentence, depth in [0, 1]); a piece's ``value``-style sub-span can
    be located later with ``Context.find``. Returns the text and each piece's char span."""
    for name, sentence, depth in pieces:
        check_range(f"depth of {name}", depth, 0.0, 1.0)
    ordered = sorted(pieces, key=lambda p: p[2])
    cut_points = [sentence_boundary(haystack, int(round(d * len(haystack)))) for _, _, d in ordered]
    out, spans, prev = [], {}, 0
    length = 0
    for (name, sentence, _), cut in zip(ordered, cut_points):
        before = haystack[prev:cut]
        out.append(before)
        length += len(before)
        sep_l = "" if length == 0 or before.endswith((" ", "\n")) else " "
        sep_r = " "
        piece = f"{sep_l}{sentence}{sep_r}"
        spans[name] = (length + len(sep_l), length + len(sep_l) + len(sentence))
        out.append(piece)
        length += len(piece)
        prev = cut
    out.append(haystack[prev:])
    text = "".join(out)
    stripped = text.rstrip()
    return Context(text=stripped, spans={k: (a, min(b, len(stripped))) for k, (a, b) in spans.items()})


def sub_span(ctx: Context, name: str, inner: str) -> tuple[int, int]:
    """Char span of ``inner`` inside the piece ``name`` of ``ctx``."""
    a, b = ctx.spans[name]
    i = ctx.text.find(inner, a, b)
    require(i >= 0, "inner", inner, f"a substring of piece {name!r}")
    return i, i + len(inner)


def token_span(offsets: list[tuple[int, int]], char_span: tuple[int, int], shift: int = 0) -> tuple[int, int]:
    """[first, last + 1) token indices whose characters overlap ``char_span`` (shifted by ``shift``)."""
    a, b = char_span[0] + shift, char_span[1] + shift
    idx = [i for i, (s, e) in enumerate(offsets) if e > a and s < b and e > s]
    require(bool(idx), "char_span", char_span, "a span covered by at least one token")
    return idx[0], idx[-1] + 1


def random_word(rng: random.Random, lo: int = 3, hi: int = 6) -> str:
    """A made-up lowercase word (FWE's coded words)."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


# ---------------------------------------------------------------------------- facts and distractors (issue 18)
FACT_KINDS = ("code-word", "number", "word")


def make_fact(kind: str, rng: random.Random) -> Needle:
    """A fact to recall after compression. "code-word": the README demo's format,
    'The secret code word is "lantern".' asked as "What is the secret code word? Answer with the
    word only."; "number" / "word": the reference NIAH needle of that kind."""
    check_choice("fact kind", kind, FACT_KINDS)
    if kind != "code-word":
        return make_needle(kind, rng)
    value = random_value("word", rng)
    return Needle(kind="word", value=value, sentence=f'The secret code word is "{value}".',
                  question="What is the secret code word? Answer with the word only.")


# ordinary sentences with ordinary numbers (years, counts, prices, durations): never 7 digits
_DISTRACTORS = (
    "In {year}, about {count} people came to the first meeting.",
    "The report listed {count} items at {price} dollars each.",
    "By {year} the town had grown to {count} residents.",
    "She paid {price} dollars for the old {noun} in {year}.",
    "The trip took {small} hours and covered {count} miles.",
    "Around {count} copies were sold in the first {small} weeks.",
    "The {noun} was built in {year} and repaired {small} times since.",
    "Tickets cost {price} dollars, and {count} of them were gone by noon.",
    "He spent {small} years on it and wrote {count} pages.",
    "The company moved in {year}, when it had {count} employees.",
)
_NOUNS = ("house", "bridge", "piano", "boat", "school", "library", "clock", "mill", "tower", "car")


def distractor_sentence(rng: random.Random) -> str:
    """One ordinary sentence carrying ordinary numbers (a year, a count, a price, a duration)."""
    template = rng.choice(_DISTRACTORS)
    return template.format(year=rng.randint(1900, 2023), count=rng.randint(12, 4800), price=rng.randint(2, 950),
                           small=rng.randint(2, 19), noun=rng.choice(_NOUNS))


def add_distractors(text: str, rng: random.Random, every_chars: int = 600) -> str:
    """``text`` with a distractor sentence at the sentence boundary after every ~``every_chars``
    characters (about 150 tokens of English prose)."""
    check_int("every_chars", every_chars, 1)
    out, prev, pos = [], 0, every_chars
    while pos < len(text):
        cut = sentence_boundary(text, pos)
        if cut <= prev:
            m = _SENTENCE_END.search(text, pos)
            if m is None:
                break
            cut = m.end()
        piece = text[prev:cut]
        sep = "" if piece.endswith((" ", "\n")) else " "
        out.append(f"{piece}{sep}{distractor_sentence(rng)} ")
        prev = cut
        pos = cut + every_chars
    out.append(text[prev:])
    return "".join(out)
