"""The plugin's settings: which pipeline compresses a request's prompt, and the block rule.

Engine level, from (first found) ``LLM(..., additional_config={"kvcompress": {...}})`` or the
environment:

    KVCOMPRESS_VLLM_PRESET     preset name, e.g. "semanticache" (unset: the plugin stays off)
    KVCOMPRESS_VLLM_BUDGET     keep-ratio in (0, 1] ("0.25") or slots per head ("512")
    KVCOMPRESS_VLLM_FREE       "1" (default): return the blocks a compressed prompt no longer
                               needs to vLLM's pool; "0": compaction only (memory-neutral)
    KVCOMPRESS_VLLM_OVERRIDES  JSON object of PipelineConfig overrides ('{"recent": 32}')

Per request: ``SamplingParams(extra_args={"kvcompress": {"preset": ..., "budget": ...}})``
chooses another pipeline for that request. The block rule is decided by the scheduler, which
only knows the engine setting, so with freeing on a request may only keep as many slots as the
engine budget allows: its budget is capped there (a warning says so).

Only torch and the core are imported here, so the scheduler side and tests can use it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..api import budget_overrides
from ..config import PipelineConfig
from ..pipeline import Pipeline
from ..presets import get_preset
from ..validation import require

ENV_PRESET = "KVCOMPRESS_VLLM_PRESET"
ENV_BUDGET = "KVCOMPRESS_VLLM_BUDGET"
ENV_FREE = "KVCOMPRESS_VLLM_FREE"
ENV_OVERRIDES = "KVCOMPRESS_VLLM_OVERRIDES"
CONFIG_KEY = "kvcompress"  # key in additional_config and in SamplingParams.extra_args


def parse_budget(value) -> float | int | None:
    """A budget from a string or number: "0.25" -> 0.25 (keep-ratio), "512" -> 512 (slots)."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    require(isinstance(value, str), "budget", value, "a keep-ratio in (0, 1], a slot count or None")
    text = value.strip()
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise ValueError(f"budget={value!r} is invalid: expected a keep-ratio in (0, 1] or a slot count") from None


@dataclass(frozen=True)
class Settings:
    """One pipeline choice. preset None = the plugin is off (no compression, stock attention)."""

    preset: str | None = None
    budget: float | int | None = None
    free_blocks: bool = True
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.preset is not None

    def config(self) -> PipelineConfig | None:
        """The PipelineConfig, or None for no compression (preset "full" also compresses nothing)."""
        if self.preset is None:
            return None
        overrides = {**budget_overrides(self.budget), **dict(self.overrides)}
        return get_preset(self.preset, **overrides)

    def pipeline(self) -> Pipeline | None:
        cfg = self.config()
        if cfg is None:
            return None
        check_supported(cfg)
        return Pipeline(cfg)

    def to_dict(self) -> dict:
        return {"preset": self.preset, "budget": self.budget, "free_blocks": self.free_blocks,
                "overrides": dict(self.overrides)}

    @classmethod
    def from_mapping(cls, data: Mapping, base: "Settings | None" = None) -> "Settings":
        require(isinstance(data, Mapping), CONFIG_KEY, data, "a dict with keys preset, budget, free_blocks, overrides")
        extra = sorted(set(data) - {"preset", "budget", "free_blocks", "overrides"})
        require(not extra, CONFIG_KEY, extra, "only the keys preset, budget, free_blocks, overrides")
        base = base or cls()
        overrides = data.get("overrides", base.overrides)
        require(isinstance(overrides, Mapping), "overrides", overrides, "a dict of PipelineConfig overrides")
        settings = cls(
            preset=data.get("preset", base.preset),
            budget=parse_budget(data.get("budget", base.budget)),
            free_blocks=bool(data.get("free_blocks", base.free_blocks)),
            overrides=dict(overrides),
        )
        settings.config()  # a bad preset or budget is a ValueError now, not in the engine loop
        return settings

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        overrides = json.loads(env[ENV_OVERRIDES]) if env.get(ENV_OVERRIDES) else {}
        free = env.get(ENV_FREE, "1").strip().lower()
        require(free in ("0", "1", "true", "false", "yes", "no"), ENV_FREE, env.get(ENV_FREE), "1 or 0")
        return cls.from_mapping({"preset": env.get(ENV_PRESET) or None, "budget": env.get(ENV_BUDGET) or None,
                                 "free_blocks": free in ("1", "true", "yes"), "overrides": overrides})

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "Settings":
        """additional_config["kvcompress"] when given, else the environment."""
        extra = getattr(vllm_config, "additional_config", None) or {}
        env = cls.from_env()
        if CONFIG_KEY in extra:
            return cls.from_mapping(extra[CONFIG_KEY], base=env)
        return env


def check_supported(cfg: PipelineConfig) -> None:
    """Pipelines whose statistics the vLLM plugin cannot collect are refused up front."""
    require(not cfg.track_attention, "preset", cfg.name,
            "a pipeline without track_attention (the vLLM plugin collects the last queries "
            "(query_window) but not accumulated attention; use the transformers path for h2o/d2o)")
    needs = getattr(Pipeline(cfg), "needs", None)  # the Needs contract, where the core has it
    if needs is not None:
        require(not getattr(needs, "model_pass", False), "preset", cfg.name,
                "a pipeline without a model pass at the prefill's end (not available in vLLM)")
        require(not getattr(needs, "attention", False), "preset", cfg.name,
                "a pipeline that needs no accumulated attention statistics")
        require(not getattr(needs, "reference_queries", 0), "preset", cfg.name,
                "a pipeline that needs no strided reference queries")


def kept_slots(prompt_tokens: int, cfg: PipelineConfig | None) -> int:
    """The most slots any head of any layer may hold after compressing ``prompt_tokens`` tokens:
    the budget (Pipeline.target_slots' rule), or all tokens when the budget may be exceeded
    (best-effort pipelines, full heads) or there is no compression."""
    if cfg is None or cfg.full_heads or cfg.on_infeasible != "error":
        return prompt_tokens
    if cfg.keep_ratio is not None:
        return min(prompt_tokens, max(1, int(prompt_tokens * cfg.keep_ratio + 1e-9)))
    return min(prompt_tokens, cfg.max_slots)


def freed_blocks(prompt_tokens: int, cfg: PipelineConfig | None, block_size: int) -> int:
    """Leading blocks of a compressed prompt that hold no slot: the compressed slots are written
    to the END of the prompt's range, [P - kept, P), so blocks below (P - kept) // block_size can
    go back to the pool. The scheduler and the worker both use this one rule."""
    return (prompt_tokens - kept_slots(prompt_tokens, cfg)) // block_size
