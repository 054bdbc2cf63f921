"""Greedy decoding over a prepared cache, and the prompt split the protocols use."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..validation import check_int, require


@dataclass
class Prompt:
    """Token ids of a chat prompt cut right after the context.

    head: [1, Th] the system/user preamble and the context (what query-agnostic compresses)
    tail: [1, Tt] the question and the assistant preamble (fed uncompressed after it)
    context_offset: char offset of the context inside the decoded head text
    offsets: (start, end) char offsets of every head token in the head text
    """

    head: Tensor
    tail: Tensor
    head_text: str
    context_offset: int
    offsets: list
    chat: bool

    def aware_prefix(self) -> Tensor:
        """[1, Th + Tt - 1]: what query-aware compresses (all but the last prompt token, which is
        fed over the compressed cache so that every answer token sees only compressed slots)."""
        return torch.cat([self.head, self.tail[:, :-1]], dim=1)

    def aware_last(self) -> Tensor:
        return self.tail[:, -1:]


def build_prompt(tokenizer, context: str, question: str, chat: bool | None = None) -> Prompt:
    """Render ``context`` + ``question`` (with the chat template when the tokenizer has one and
    ``chat`` is not False) and tokenise it in two parts cut after the context."""
    from ..hf.generate import split_prompt

    head, tail, used_chat = split_prompt(tokenizer, context, question, chat)
    enc = tokenizer(head, add_special_tokens=not used_chat, return_offsets_mapping=True)
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    require(len(tail_ids) >= 1, "question", question, "a question that renders to at least one token")
    return Prompt(head=torch.tensor([enc["input_ids"]]), tail=torch.tensor([tail_ids]), head_text=head,
                  context_offset=head.rindex(context), offsets=[tuple(o) for o in enc["offset_mapping"]],
                  chat=used_chat)


def stop_ids(tokenizer) -> set:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    return ids


def greedy(model, cache, first: Tensor, max_new_tokens: int, stop: set = frozenset()) -> tuple[list[int], float]:
    """Feed ``first`` [1, q] over ``cache``, then pick argmax tokens; returns (new ids, seconds).
    The first forward may hold many tokens (the question): the cache serves it causally."""
    from ..hf.generate import cache_kwarg

    check_int("max_new_tokens", max_new_tokens, 1)
    key = cache_kwarg(model)
    new: list[int] = []
    start = time.perf_counter()
    ids = first
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
            nxt = int(out.logits[0, -1].argmax())
            if nxt in stop:
                break
            new.append(nxt)
            ids = torch.tensor([[nxt]], device=first.device)
    return new, time.perf_counter() - start
