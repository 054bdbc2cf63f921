"""kvcompress for vLLM (optional extra ``vllm``; the core never imports this package).

    import kvcompress.vllm as kvv
    llm = LLM(model_dir, **kvv.engine_kwargs("semanticache", budget=0.25))
    out = llm.generate(prompts, SamplingParams(max_tokens=64))

See docs/vllm.md. Modules: ``settings`` (engine/per-request settings, the block rule; torch
only), ``compaction`` (compress one request inside the paged cache; torch only), ``backend``
(FlexAttention with the bias, the spec and manager that free blocks), ``worker`` (the workers
that compress after the prefill), ``plugin`` (the ``vllm.general_plugins`` entry point),
``convert`` (SmolLM2 GGUF -> a folder vLLM loads).
"""

from __future__ import annotations

from .settings import CONFIG_KEY, BlockRule, Settings


def engine_kwargs(preset: str | None = "semanticache", budget: float | int | None = 0.25, *,
                  free_blocks: bool = True, device: str = "cpu", **overrides) -> dict:
    """Keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs`` that turn the plugin on.

    preset/budget/overrides: the engine's pipeline (``additional_config["kvcompress"]``);
    free_blocks: return the blocks a compressed prompt no longer needs to the pool;
    device: "cpu" or "cuda" (chooses the worker class).
    Prefix caching is switched off: compressed blocks are rewritten in place and cannot be shared.
    """
    from ..validation import check_choice

    check_choice("device", device, ("cpu", "cuda"))
    settings = Settings.from_mapping({"preset": preset, "budget": budget, "free_blocks": free_blocks,
                                      "overrides": overrides})
    worker = "kvcompress.vllm.worker.CPUWorker" if device == "cpu" else "kvcompress.vllm.worker.GPUWorker"
    kwargs = {"worker_cls": worker, "enable_prefix_caching": False,
              "additional_config": {CONFIG_KEY: settings.to_dict()}}
    if device == "cuda":
        kwargs["attention_backend"] = "FLEX_ATTENTION"
    return kwargs


def request_args(preset: str, budget: float | int | None = None, **overrides) -> dict:
    """``SamplingParams(extra_args=...)`` choosing another pipeline for one request."""
    data = {"preset": preset, "budget": budget}
    if overrides:
        data["overrides"] = overrides
    Settings.from_mapping(data)
    return {CONFIG_KEY: data}


__all__ = ["engine_kwargs", "request_args", "Settings", "BlockRule", "CONFIG_KEY"]
