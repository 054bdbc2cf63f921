"""The plugin's settings: which pipeline compresses a request's prompt, and the block rule.

Engine level, from (first found) ``LLM(..., additional_config={"kvcompress": {...}})`` or the
environment:

    KVCOMPRESS_VLLM_PRESET     preset name, e.g. "semanticache" (unset: the plugin stays off)
    KVCOMPRESS_VLLM_BUDGET     keep-ratio in (0, 1] ("0.25") or slots per head ("512")
    KVCOMPRESS_VLLM_FREE       "1" (default): return the blocks a compressed prompt no longer
                               needs to vLLM's pool; "0": compaction only (memory-neutral)
    KVCOMPRESS_VLLM_OVERRIDES  JSON object of PipelineConfig overrides ('{"recent": 32}')

Per request: ``SamplingParams(extra_args={"kvcompress": {"preset": ..., "budget": ...}})``, or
the flat ``kvcompress_preset`` / ``kvcompress_budget`` keys (the OpenAI server's ``vllm_xargs``),
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
from ..budget import target_slots
from ..config import PipelineConfig
from ..pipeline import Pipeline
from ..presets import get_preset
from ..protocols import budget_scope_of
from ..validation import require

ENV_PRESET = "KVCOMPRESS_VLLM_PRESET"
ENV_BUDGET = "KVCOMPRESS_VLLM_BUDGET"
ENV_FREE = "KVCOMPRESS_VLLM_FREE"
ENV_OVERRIDES = "KVCOMPRESS_VLLM_OVERRIDES"
CONFIG_KEY = "kvcompress"  # key in additional_config and in SamplingParams.extra_args
FLAT_PREFIX = "kvcompress_"  # flat extra_args keys (vllm_xargs of the OpenAI server)


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
        pipeline = Pipeline(cfg)
        check_supported(pipeline)
        return pipeline

    def key(self) -> tuple:
        """A hashable identity of the pipeline choice."""
        return (self.preset, self.budget, json.dumps(dict(self.overrides), sort_keys=True, default=str))

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
    def from_extra_args(cls, extra: Mapping | None, base: "Settings") -> "Settings | None":
        """A request's own setting from ``SamplingParams.extra_args``, or None when it has none:
        ``{"kvcompress": {"preset": ..., "budget": ...}}`` (Python), or the flat keys
        ``kvcompress_preset`` / ``kvcompress_budget`` / ``kvcompress_overrides`` (a JSON string),
        which is what the OpenAI server's ``vllm_xargs`` can carry (no nested objects)."""
        extra = extra or {}
        if CONFIG_KEY in extra:
            return cls.from_mapping(extra[CONFIG_KEY], base=base)
        flat = {k[len(FLAT_PREFIX):]: v for k, v in extra.items() if k.startswith(FLAT_PREFIX)}
        if not flat:
            return None
        if isinstance(flat.get("overrides"), str):
            try:
                flat["overrides"] = json.loads(flat["overrides"])
            except json.JSONDecodeError:
                raise ValueError(f"{FLAT_PREFIX}overrides={flat['overrides']!r} is invalid: expected a JSON "
                                 "object of PipelineConfig overrides") from None
        return cls.from_mapping(flat, base=base)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        try:
            overrides = json.loads(env[ENV_OVERRIDES]) if env.get(ENV_OVERRIDES) else {}
        except json.JSONDecodeError:
            raise ValueError(f"{ENV_OVERRIDES}={env[ENV_OVERRIDES]!r} is invalid: expected a JSON object of "
                             "PipelineConfig overrides") from None
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


def check_supported(pipeline: Pipeline) -> None:
    """Pipelines whose statistics the vLLM plugin cannot collect are refused up front: it
    records prompt queries (``Needs.query_window``, ``Needs.reference_queries``) and nothing else."""
    needs, name = pipeline.needs, pipeline.config.name
    require(not needs.attention, "preset", name,
            "a pipeline that needs no accumulated attention (the vLLM plugin records the last "
            "queries (query_window) only; use the transformers path for h2o/d2o)")
    require(not needs.model_pass, "preset", name,
            "a pipeline without a model pass at the prefill's end (not available in vLLM)")


@dataclass(frozen=True)
class BlockRule:
    """The most slots a compressed prompt may keep, known before it is compressed.

    The scheduler frees a prompt's leading blocks from this rule alone (it never sees the
    compressed state), and the worker makes every layer fit it. ``frees`` False: the prompt
    keeps every block (freeing off, no compression, full heads, or Ada-KV layer budgets, whose
    heads may each keep up to the whole prompt).
    """

    keep_ratio: float | None = None
    max_slots: int | None = None
    frees: bool = False

    @classmethod
    def of(cls, settings: Settings) -> "BlockRule":
        if not (settings.enabled and settings.free_blocks):
            return cls()
        pipeline = settings.pipeline()
        cfg = pipeline.config
        if cfg.full_heads or budget_scope_of(pipeline.clusterer) == "layer":
            return cls()
        return cls(keep_ratio=cfg.keep_ratio, max_slots=cfg.max_slots, frees=True)

    def kept(self, prompt_tokens: int) -> int:
        """Slots per head and layer a prompt of ``prompt_tokens`` tokens may keep (the
        pipeline's own budget rule, ``kvcompress.budget.target_slots``)."""
        if not self.frees:
            return prompt_tokens
        return min(prompt_tokens, target_slots(prompt_tokens, self.keep_ratio, self.max_slots))

    def freed(self, prompt_tokens: int, block_size: int) -> int:
        """Leading blocks of the prompt that hold no slot: the compressed slots are written to
        the END of the prompt's range, [P - kept, P), so the blocks below (P - kept) // block_size
        go back to the pool. The scheduler and the worker both use this one rule."""
        return (prompt_tokens - self.kept(prompt_tokens)) // block_size
