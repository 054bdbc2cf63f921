"""Merging presets whose merged slots are fitted to their clusters' attention (issue 14).

Each is the named preset with the ``fitted`` merger: the clusters are the method's own; only the
merged slots' key, value and attention bias differ (fitted to 64 strided prefill queries of each
layer, recorded by the cache). The SemantiCache variant uses fixed 64-token chunks (delimiter
anchors alone floor the keep ratio near 0.3, as for semanticache-safe).
"""

from ..config import PipelineConfig, StrategySpec
from . import register_preset
from .centroidkv import centroidkv, centroidkv_safe
from .semanticache import semanticache_fixed64, semanticache_safe

FITTED = StrategySpec("fitted", {"reference_queries": 64})


def _fitted(base: PipelineConfig, name: str) -> PipelineConfig:
    return base.replace(name=name, merger=FITTED)


@register_preset("centroidkv-fitted")
def centroidkv_fitted() -> PipelineConfig:
    return _fitted(centroidkv(), "centroidkv-fitted")


@register_preset("centroidkv-safe-fitted")
def centroidkv_safe_fitted() -> PipelineConfig:
    return _fitted(centroidkv_safe(), "centroidkv-safe-fitted")


@register_preset("semanticache-fitted")
def semanticache_fitted() -> PipelineConfig:
    return _fitted(semanticache_fixed64(), "semanticache-fitted")


@register_preset("semanticache-safe-fitted")
def semanticache_safe_fitted() -> PipelineConfig:
    return _fitted(semanticache_safe(), "semanticache-safe-fitted")
