"""The cache of converted model files (kvcompress.hf.loading): keyed by the file's bytes, not its
time, and older entries removed, so repeated installs do not fill the disk."""

from __future__ import annotations

import os
import time

from kvcompress.hf.loading import content_key, prune_cache


def test_content_key_follows_bytes_not_time(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(3 << 20))
    key = content_key(f)
    os.utime(f, (1, 1))  # a fresh install: same bytes, another time
    assert content_key(f) == key
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # a different tail
    f.write_bytes(bytes(data))
    assert content_key(f) != key
    data[0] ^= 1
    data[-1] ^= 1  # a different head
    f.write_bytes(bytes(data))
    assert content_key(f) != key
    f.write_bytes(bytes(data) + b"x")  # a different size
    assert content_key(f) != key


def test_content_key_of_a_small_file(tmp_path):
    f = tmp_path / "small"
    f.write_bytes(b"abc")
    assert content_key(f) == content_key(f) and content_key(f).startswith("3-")


def test_prune_removes_other_entries_and_stale_unfinished_ones_only(tmp_path):
    for name in ("smollm2-hf-1-aa", "smollm2-hf-2-bb", "smollm2-hf-2-bb.tmp11", "smollm2-hf-3-cc.tmp12",
                 "smollm2-tokenizer-1-aa", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "w").write_bytes(b"0" * 10)
    old = time.time() - 7200
    os.utime(tmp_path / "smollm2-hf-2-bb.tmp11", (old, old))  # a run that died two hours ago
    removed = prune_cache(tmp_path, "smollm2-hf-", "smollm2-hf-1-aa")
    assert sorted(p.name for p in removed) == ["smollm2-hf-2-bb", "smollm2-hf-2-bb.tmp11"]
    # the kept entry, a run still writing, and other caches stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "smollm2-hf-1-aa", "smollm2-hf-3-cc.tmp12",
                                                          "smollm2-tokenizer-1-aa"]
    assert prune_cache(tmp_path / "missing", "smollm2-hf-", "x") == []
