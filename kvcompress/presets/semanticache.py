"""SemantiCache (arXiv 2603.14303) and its chunking ablations."""

from ..config import PipelineConfig, StrategySpec
from . import register_preset

# The paper leaves sinks and the recent window open; a few of each is standard practice.
SEMANTICACHE_SINKS = 4
SEMANTICACHE_RECENT = 32


@register_preset("semanticache")
def semanticache() -> PipelineConfig:
    return PipelineConfig(
        name="semanticache",
        keep_ratio=0.5,
        sinks=SEMANTICACHE_SINKS,
        recent=SEMANTICACHE_RECENT,
        chunker=StrategySpec("delimiter"),
        clusterer=StrategySpec("gsc"),
        merger=StrategySpec("mean"),
    )


@register_preset("semanticache-fixed64")
def semanticache_fixed64() -> PipelineConfig:
    """Ablation: fixed chunks of 64 tokens, no delimiter anchors."""
    return semanticache().replace(name="semanticache-fixed64", chunker=StrategySpec("fixed", {"size": 64}))


@register_preset("semanticache-global")
def semanticache_global() -> PipelineConfig:
    """Ablation: no chunking, GSC over the whole cache of a head."""
    return semanticache().replace(name="semanticache-global", chunker=StrategySpec("global"))
