"""Convert the embedded SmolLM2 GGUF model to an ordinary model folder that vLLM can load.

vLLM 0.32 has no GGUF loader. The folder is written once under ``kvcompress`` 's cache directory
(``$KVCOMPRESS_CACHE_DIR`` or ``~/.cache/kvcompress``) and reused; about 65 s and 517 MB.

    python -m kvcompress.vllm.convert            # prints the folder
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def smollm2_folder(target: str | os.PathLike | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder (float32 safetensors + tokenizer), built on first use."""
    from ..hf.loading import SMOLLM2_GGUF, cache_dir, smollm2_dir

    source = smollm2_dir()
    stat = (source / SMOLLM2_GGUF).stat()
    folder = Path(target) if target is not None else cache_dir() / f"smollm2-hf-{stat.st_size}-{int(stat.st_mtime)}"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # the GGUF marker is not serialisable and would make vLLM look for a GGUF loader
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # the weights are dequantised float32 already
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: a concurrent run sees all of it or nothing
    return folder


if __name__ == "__main__":
    print(smollm2_folder(sys.argv[1] if len(sys.argv) > 1 else None))
