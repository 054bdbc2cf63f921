"""kvcompress: KV-cache compression by semantic merging, as composable strategies.

The core (types, registry, pipeline, strategies) needs only torch; the transformers integration
lives in ``kvcompress.hf`` and is imported only when used.
"""

from .attention import expand_state, proportional_attention
from .config import PipelineConfig, StrategySpec, as_config
from .pipeline import BudgetError, BudgetWarning, Pipeline
from .presets import get_preset, list_presets, register_preset
from .protocols import Chunker, ClusterPlan, Clusterer, Guard, Merger, Scorer
from .registry import (
    CHUNKERS, CLUSTERERS, GUARDS, MERGERS, SCORERS, list_strategies, load_plugins,
    register_chunker, register_clusterer, register_guard, register_merger, register_scorer,
)
from .types import CompressionReport, KVState
from . import strategies  # noqa: F401  (registers the built-ins)

__version__ = "0.1.0"

__all__ = [
    "KVState", "CompressionReport", "PipelineConfig", "StrategySpec", "as_config", "Pipeline",
    "BudgetError", "BudgetWarning", "get_preset", "list_presets", "register_preset", "Chunker", "Clusterer",
    "Merger", "Scorer", "Guard", "ClusterPlan", "CHUNKERS", "CLUSTERERS", "MERGERS", "SCORERS",
    "GUARDS", "register_chunker", "register_clusterer", "register_merger", "register_scorer",
    "register_guard", "list_strategies", "load_plugins", "proportional_attention", "expand_state",
]


def __getattr__(name: str):
    # kvcompress.generate needs transformers; import it on first use so the core stays torch-only
    if name == "generate":
        from .api import generate

        return generate
    raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")
