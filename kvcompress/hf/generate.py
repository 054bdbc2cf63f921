"""Generation with a compressed cache: prefill and compress a context, then ask and decode.

The context is prefilled (each layer compresses itself right after its attention in that
forward); an optional question follows as a multi-token input over the compressed cache (so the
compression does not depend on the question); then ``model.generate`` decodes, with decode-time
recompression. Times are measured per phase.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from ..validation import check_int, require
from .cache import CompressedCache


@dataclass
class GenerationResult:
    """text: the generated answer; token_ids: its ids; report: sizes, slots and times.

    Unpacks as ``text, report = kvcompress.generate(...)``.
    """

    text: str
    token_ids: list[int]
    report: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text

    def __iter__(self):
        return iter((self.text, self.report))


def cache_kwarg(model) -> str:
    """The forward/generate keyword for the cache: "cache" in transformers >= 5.x releases that
    renamed it, else "past_key_values"."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def split_prompt(tokenizer, context: str, question: str | None, chat: bool | None) -> tuple[str, str, bool]:
    """(context part, question part, whether a chat template was used) of the full prompt text.

    With a chat template, the user message is context + question and the text is cut right
    after the context, so the compressed part is exactly the rendered context.
    """
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        require(bool(getattr(tokenizer, "chat_template", None)), "chat", chat,
                "False for a tokenizer without a chat template")
        content = context if not question else f"{context}\n\n{question}"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        at = rendered.find(context)
        if at < 0:  # a template that rewrites the text: compress the whole rendered prompt
            return rendered, "", True
        cut = at + len(context)
        return rendered[:cut], rendered[cut:], True
    return context, (f"\n\n{question}\n" if question else ""), False


def generate(model, tokenizer, context: str, *, question: str | None = None, pipeline="semanticache",
             max_new_tokens: int = 64, chat: bool | None = None, backend: str = "auto", do_sample: bool = False,
             num_beams: int = 1, generation_kwargs: dict | None = None, prefill_chunk: int | None = None,
             **overrides) -> GenerationResult:
    """Compress ``context`` with ``pipeline`` (+ overrides), then answer ``question``.

    prefill_chunk: prefill C tokens at a time, compressing after each chunk (``cache.prefill``),
    so the KV held stays within the budget of the tokens seen + C; None: one forward.

    Returns the decoded new text and a report with kv_bytes_full / kv_bytes_compressed (after
    the prefill), slots per layer, prefill_s (the model's prefill alone), compress_s, reconstruct_s and
    surprisal_s (the question-free scorers' passes over the context, 0 without them), decode_s
    (question + new tokens, decode-time compression included) and the flex compile count.
    """
    require(isinstance(context, str) and context != "", "prompt", context, "a non-empty string")
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("num_beams", num_beams, 1)
    if prefill_chunk is not None:
        check_int("prefill_chunk", prefill_chunk, 1)
    device = next(model.parameters()).device
    head, tail, used_chat = split_prompt(tokenizer, context, question, chat)
    ids = tokenizer(head, return_tensors="pt", add_special_tokens=not used_chat)["input_ids"].to(device)
    tail_ids = tokenizer(tail, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    if tail_ids.shape[1] == 0:
        # generate feeds at least one prompt token itself: keep the last one for it
        ids, tail_ids = ids[:, :-1], ids[:, -1:]
    require(ids.shape[1] >= 1, "prompt", context, "text of at least two tokens")

    cache = CompressedCache.for_model(model, tokenizer, pipeline, backend=backend, **overrides)
    key = cache_kwarg(model)
    try:
        with torch.inference_mode():
            _sync(device)
            start = time.perf_counter()
            # the base model: the prefill needs no logits ([L, vocab] floats for a long prompt)
            cache.prefill(ids, chunk=prefill_chunk)
            _sync(device)
            prefill_total = time.perf_counter() - start
            compress_s = cache.stats["compress_s"]
            # the question-free scorers' model passes run inside the prefill; they are reported apart
            reconstruct_s = cache.stats.get("reconstruct_s", 0.0)
            surprisal_s = cache.stats.get("surprisal_s", 0.0)
            after_prefill = cache.report()

            if num_beams > 1:
                cache.batch_repeat_interleave(num_beams)  # generate expands the inputs, not the cache
            full = torch.cat([ids, tail_ids], dim=1)
            gen_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, num_beams=num_beams)
            if tokenizer.pad_token_id is not None:
                gen_kwargs["pad_token_id"] = tokenizer.pad_token_id
            gen_kwargs.update(generation_kwargs or {})
            _sync(device)
            start = time.perf_counter()
            out = model.generate(input_ids=full, attention_mask=torch.ones_like(full), **{key: cache}, **gen_kwargs)
            _sync(device)
            decode_s = time.perf_counter() - start
    finally:
        cache.close()
    new = out[0, full.shape[1]:].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    final = cache.report()
    report = {
        "answer": text.strip(),
        "pipeline": cache.config.to_dict() if cache.config is not None else None,
        "context_tokens": int(ids.shape[1]),
        "question_tokens": int(tail_ids.shape[1]),
        "new_tokens": len(new),
        "kv_bytes_full": after_prefill["kv_bytes_full"],
        "kv_bytes_compressed": after_prefill["kv_bytes_compressed"],
        "compression_ratio": after_prefill["kv_bytes_compressed"] / max(1, after_prefill["kv_bytes_full"]),
        "slots_per_layer": after_prefill["slots_per_layer"],
        "valid_slots_per_layer": after_prefill["valid_slots_per_layer"],
        "budget_scale_per_layer": after_prefill["budget_scale_per_layer"],
        "prefill_s": prefill_total - compress_s - reconstruct_s - surprisal_s,
        "compress_s": compress_s,
        "reconstruct_s": reconstruct_s,
        "surprisal_s": surprisal_s,
        "decode_s": decode_s,
        "decode_compress_s": cache.stats["compress_s"] - compress_s,
        "decode_compressions": cache.stats["decode_compressions"],
        "tokens_per_s": len(new) / decode_s if decode_s > 0 else None,
        "kv_bytes_end": final["kv_bytes_compressed"],
        "kv_bytes_full_end": final["kv_bytes_full"],
        "compiles": final["compiles"],
        "prefill_chunk": prefill_chunk,
        "backend": backend,
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    return GenerationResult(text=text, token_ids=new, report=report)
