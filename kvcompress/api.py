"""The one-call helper: ``kvcompress.generate(model, tokenizer, prompt, ...)``.

    import kvcompress
    result = kvcompress.generate(model, tokenizer, long_text, preset="semanticache", budget=0.25,
                                 question="Who wrote it?", max_new_tokens=64)
    print(result.text)
    print(result.report["kv_bytes_full"], result.report["kv_bytes_compressed"])

The prompt (the long context) is prefilled and compressed layer by layer; the question, if any,
follows over the compressed cache; then the model decodes with decode-time recompression. To use
the compressed cache with ``model.generate`` directly, see ``kvcompress.hf.CompressedCache``.
Imported lazily by ``kvcompress`` (it needs transformers; the core needs only torch).
"""

from __future__ import annotations

from typing import Mapping

from .config import PipelineConfig
from .validation import check_int, check_range, require


def budget_overrides(budget) -> dict:
    """A budget as PipelineConfig overrides: a float in (0, 1] is a keep-ratio (fraction of the
    tokens kept as slots), an int >= 1 a fixed slot cap per head, None keeps the preset's."""
    if budget is None:
        return {}
    if isinstance(budget, int) and not isinstance(budget, bool):
        check_int("budget", budget, 1)
        return {"max_slots": budget, "keep_ratio": None}
    require(isinstance(budget, float), "budget", budget,
            "a keep-ratio in (0, 1] (float), a slot count >= 1 (int) or None")
    check_range("budget", budget, 0.0, 1.0, lo_open=True)
    return {"keep_ratio": budget, "max_slots": None}


def generate(
    model,
    tokenizer,
    prompt: str,
    preset: "str | Mapping | PipelineConfig | None" = "semanticache",
    budget: float | int | None = 0.25,
    max_new_tokens: int = 64,
    *,
    question: str | None = None,
    chat: bool | None = None,
    backend: str = "auto",
    do_sample: bool = False,
    num_beams: int = 1,
    generation_kwargs: dict | None = None,
    prefill_chunk: int | None = None,
    **overrides,
):
    """Compress ``prompt``'s KV cache with ``preset`` at ``budget`` and generate.

    model, tokenizer: a transformers causal LM (full attention, Llama family) and its tokenizer
    prompt:    the long context (compressed)
    preset:    a preset name ("semanticache", ...), a dict or a PipelineConfig; None = full cache
    budget:    keep-ratio in (0, 1] (float) or slots per head (int); None = the preset's budget
    question:  optional text asked after the compressed context (not compressed itself)
    chat:      wrap in the tokenizer's chat template (None: when it has one)
    backend:   attention backend, "auto" (SDPA on CUDA, the faster one on CPU), "flex", "sdpa"
    prefill_chunk: prefill the prompt C tokens at a time, compressing after each chunk, so the KV
               held never exceeds the budget of the tokens seen + C (None: one forward, the whole
               prompt's KV held until it is compressed)
    overrides: PipelineConfig fields or "clusterer.tau"-style strategy params
               (``**{"clusterer.tau": 0.9}``)
    returns    GenerationResult: ``.text``, ``.token_ids`` and ``.report`` (answer, keep_reached,
               budget_met, kv_bytes_full, kv_bytes_compressed, slots_per_layer, prefill_s, ...)

    A budget the method cannot reach gives the smallest cache it reaches and ONE BudgetWarning
    naming the keep reached and why (``on_infeasible="error"`` raises BudgetError instead); a
    prompt no longer than the preset's sinks + recent window stays uncompressed.
    """
    from .hf.generate import generate as _generate
    from .pipeline import budget_warnings, summarize_shortfalls

    check_int("max_new_tokens", max_new_tokens, 1)
    if prefill_chunk is not None:
        check_int("prefill_chunk", prefill_chunk, 1)
    if preset is None:
        require(budget is None or budget == 1.0, "budget", budget, "None when preset=None (full cache)")
        require(not overrides, "overrides", sorted(overrides), "none when preset=None (full cache)")
    else:
        overrides = {**budget_overrides(budget), **overrides}
    with budget_warnings() as notes:
        result = _generate(model, tokenizer, prompt, question=question, pipeline=preset,
                           max_new_tokens=max_new_tokens, chat=chat, backend=backend, do_sample=do_sample,
                           num_beams=num_beams, generation_kwargs=generation_kwargs,
                           prefill_chunk=prefill_chunk, **overrides)
    result.report.update(keep_summary(result.report))
    result.report["budget_note"] = summarize_shortfalls(notes) if notes else None
    return result


def keep_summary(report: dict) -> dict:
    """keep_reached (worst head's slots / context tokens after the prefill), keep_mean, keep_total
    (the cache's size: slots of every layer / (layers * tokens)) and budget_met (every layer within
    its share of the budget, ``budget_scale_per_layer``, and the cache within the budget), from a
    generation report (``slots_per_layer``, ``valid_slots_per_layer``, ``context_tokens`` and the
    ``pipeline`` config dict)."""
    tokens = max(1, int(report["context_tokens"]))
    slots = report.get("slots_per_layer") or [tokens]
    valid = report.get("valid_slots_per_layer") or slots
    scales = report.get("budget_scale_per_layer") or [1.0] * len(slots)
    out = {"keep_reached": round(max(slots) / tokens, 5), "keep_mean": round(sum(valid) / len(valid) / tokens, 5),
           "keep_total": round(sum(slots) / len(slots) / tokens, 5)}
    cfg = report.get("pipeline")
    if cfg is None:
        out["budget_met"] = True
    else:
        short = tokens <= cfg.get("sinks", 0) + cfg.get("recent", 0)  # stays whole by design
        even = tokens * cfg["keep_ratio"] if cfg.get("keep_ratio") is not None else cfg["max_slots"]
        layers_ok = all(n <= max(1, int(even * s + 1e-9)) for n, s in zip(slots, scales))
        out["budget_met"] = bool(short or (layers_ok and sum(slots) <= even * len(slots) + 1e-9))
    return out
