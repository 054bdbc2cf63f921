"""Helpers for the eval tests (no tests here): a tiny word-level tokenizer with a chat template and a tiny
(built in the test, no downloads), and the module fixtures the eval test files share (import them by name:
``one_thread`` is autouse, ``tok`` the tokenizer, ``model`` the model)."""

from __future__ import annotations

import re

import pytest
import torch

TEXT = ("The cat sat on the mat. The dog ran far, and the big red dog sat down. "
        "A bird sang in the tall tree. The sun rose over the quiet hills. "
        "Children played in the park while their parents talked. ") * 3
QUESTION_WORDS = ("What is the special magic number word uuid mentioned in text provided One of for s VAR Find all "
                  "variables that are assigned value above most common words list frequently appeared coded are "
                  "three and")
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvcompress.eval.data import WORDS

    words = sorted(set(re.findall(r"[A-Za-z]+", TEXT + " " + QUESTION_WORDS)) | set(WORDS))
    pieces = ["[UNK]"] + list("0123456789") + list(".,?!:-'\"()") + words + ["user", "assistant", "system"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    out.chat_template = CHAT
    return out


def tiny_model(vocab_size: int, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompress.hf import register_attention

    register_attention()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # well separated greedy choices
    model.set_attn_implementation("kvcompress")
    return model


class ForwardCounter:
    """Counts forwards of ``model.base_model`` by input length."""

    def __init__(self, model):
        self.lengths: list[int] = []
        self.handle = model.base_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[1]))

    def close(self):
        self.handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids oversubscription on a shared 2-core machine (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(len(tok))


def stub_eval_cli(monkeypatch, model, tok, folder, text: str = TEXT):
    """`kvcompress eval` on the tiny model: its model and tokenizer loaders return ``model`` /
    ``tok``; returns a haystack folder under ``folder`` holding ``text`` as one essay."""
    from kvcompress import cli_eval

    monkeypatch.setattr(cli_eval, "_load", lambda args: (model, tok, 0.0))
    monkeypatch.setattr(cli_eval, "load_tokenizer", lambda name: tok)
    hay = folder / "hay"
    hay.mkdir()
    (hay / "essay.txt").write_text(text)
    return hay
