"""The decoded text of every token id, built once per tokenizer (text-aware chunkers need it)."""

from __future__ import annotations

import weakref

_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BY_ID: dict[int, tuple[str, ...]] = {}  # tokenizers that cannot be weak-referenced


def token_texts(tokenizer) -> tuple[str, ...] | None:
    """tuple of V strings: ``vocab[i]`` is the text token ``i`` decodes to on its own.

    Decoded text, not the raw BPE piece: byte-level tokenizers store a newline as "Ċ" and a
    leading space as "Ġ"; delimiter detection must see "\\n" and " ,". Returns None for None.
    """
    if tokenizer is None:
        return None
    try:
        cached = _TABLES.get(tokenizer)
    except TypeError:
        cached = _BY_ID.get(id(tokenizer))
    if cached is not None:
        return cached
    size = len(tokenizer)
    ids = list(range(size))
    try:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        # one call per piece: joining pieces would merge byte sequences across tokens
        table = tuple(tokenizer.convert_tokens_to_string([p]) if p is not None else "" for p in pieces)
    except Exception:  # noqa: BLE001 - slow tokenizers without a token->string path
        table = tuple(tokenizer.decode([i]) for i in ids)
    try:
        _TABLES[tokenizer] = table
    except TypeError:
        _BY_ID[id(tokenizer)] = table
    return table
