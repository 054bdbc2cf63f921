"""SemantiCache (arXiv 2603.14303) and its chunking ablations."""

from ..config import PipelineConfig, StrategySpec
from . import register_preset

# The paper leaves sinks and the recent window open; a few of each is standard practice.
SEMANTICACHE_SINKS = 4
SEMANTICACHE_RECENT = 32

# The "-safe" variants keep whole sentences exact, chosen once per sequence for every head and
# layer: those the question attends to most (when it is in the prompt) and those carrying digits
# (numbers, dates, ids), within 40% of the budget; everything else is merged as the method does.
SAFE_QUERY_WINDOW = 32


def sentence_guard(share: float = 0.4) -> StrategySpec:
    return StrategySpec("sentences", {"signals": ["query", "literal"], "share": share})


# Below the paper's floor (delimiter anchors + one slot per chunk, keep ~0.28 on English prose),
# heads fall back to chunks whose delimiters are mergeable too (one slot per clause at least):
# a budget of 0.2 is met, and the BudgetWarning says the fallback was needed.
ANCHOR_FALLBACK = StrategySpec("delimiter", {"anchors": "merge"})


@register_preset("semanticache")
def semanticache() -> PipelineConfig:
    return PipelineConfig(
        name="semanticache",
        keep_ratio=0.5,
        sinks=SEMANTICACHE_SINKS,
        recent=SEMANTICACHE_RECENT,
        chunker=StrategySpec("delimiter"),
        fallback_chunker=ANCHOR_FALLBACK,
        clusterer=StrategySpec("gsc"),
        merger=StrategySpec("mean"),
    )


@register_preset("semanticache-fixed64")
def semanticache_fixed64() -> PipelineConfig:
    """Ablation: fixed chunks of 64 tokens, no delimiter anchors."""
    return semanticache().replace(name="semanticache-fixed64", chunker=StrategySpec("fixed", {"size": 64}),
                                  fallback_chunker=None)


@register_preset("semanticache-global")
def semanticache_global() -> PipelineConfig:
    """Ablation: no chunking, GSC over the whole cache of a head."""
    return semanticache().replace(name="semanticache-global", chunker=StrategySpec("global"),
                                  fallback_chunker=None)


@register_preset("semanticache-safe")
def semanticache_safe() -> PipelineConfig:
    """SemantiCache (GSC, mean merge, proportional attention) with the sentence guard, on fixed
    64-token chunks: delimiter anchors alone are 14-16% of English tokens and floor the keep
    ratio at 0.27-0.31, so a quarter of the cache is out of reach with them."""
    return semanticache().replace(name="semanticache-safe", chunker=StrategySpec("fixed", {"size": 64}),
                                  fallback_chunker=None,
                                  guards=(sentence_guard(),), query_window=SAFE_QUERY_WINDOW)
