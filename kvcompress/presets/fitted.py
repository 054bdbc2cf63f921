"""Merging presets whose merged slots are fitted to their clusters' attention (issue 14).

Each is the named preset with the ``fitted`` merger: the clusters are the method's own; only the
merged slots' key, value and attention bias differ. All fit once per compression to the layer's
last queries (``queries="window"``), which the cache keeps anyway: 32 (the ``-safe`` presets' own
query window, so their guards see the same queries as without the fit; 32 rather than 64 halves
the fit's cost at a small loss of KL, results/issue14-r), 64 for ``centroidkv-safe-fitted`` (its
guard then reads those 64 too: its same-cluster twin is centroidkv-safe with query_window=64).
Measured on SmolLM2 the window predicts the queries that follow far better than queries strided
over the prefill (docs/mergers.md). The closed form is followed by three joint key steps and a
value solve per head (``refine=3``) that move the most-attended quarter of each head's fitted
slots (``refine_share=0.25``, session 10). KL against the mean-merger twins (SmolLM2, PG / pydoc,
one run, results/issue14-targets/s10): -33.6% to -56.6% at keep 0.5 and 0.25, every pair and cell.
The fit's cost against an 8k prefill: results/issue14-cost/cost-s10.json and docs/mergers.md. The
SemantiCache variant uses fixed 64-token chunks (delimiter anchors alone floor the keep ratio
near 0.3, as for semanticache-safe).
"""

from ..config import PipelineConfig, StrategySpec
from . import register_preset
from .centroidkv import centroidkv, centroidkv_safe
from .importance import kvzip_csm
from .semanticache import semanticache_fixed64, semanticache_safe

WINDOW = 32  # last queries per layer the fit uses (the -safe presets: their query window, also 32)
# the joint key steps and value solve move the most-attended quarter of each head's fitted slots: the
# steps' cost falls about fourfold and the >= 30% KL cut held in every cell (session 9,
# results/issue14-targets/explore-s9; session 10's run: results/issue14-targets/s10)
REFINE_SHARE = 0.25


def fitted_merger(queries: str = "window", reference_queries: int = WINDOW, rounds: str = "once") -> StrategySpec:
    return StrategySpec("fitted", {"queries": queries, "reference_queries": reference_queries, "rounds": rounds,
                                   "refine_share": REFINE_SHARE})


def _fitted(base: PipelineConfig, name: str, merger: StrategySpec | None = None, rounds: str = "once") -> PipelineConfig:
    if merger is None:
        merger = fitted_merger(reference_queries=base.query_window or WINDOW, rounds=rounds)
    return base.replace(name=name, merger=merger)


@register_preset("centroidkv-fitted")
def centroidkv_fitted() -> PipelineConfig:
    return _fitted(centroidkv(), "centroidkv-fitted")


SAFE_WINDOW = 64  # centroidkv-safe-fitted's query window: its guard's and its fit's


@register_preset("centroidkv-safe-fitted")
def centroidkv_safe_fitted() -> PipelineConfig:
    """Fitted once to the last 64 queries, which its sentence guard then reads too (the guard reads
    every captured query: a same-cluster twin is centroidkv-safe with query_window=64). Its merged
    clusters are large (15-18 tokens at keep 0.25, the guard keeps most slots exact): 32 queries,
    fitted once or every round, cut KL at keep 0.25 by 24-27% only, 64 by 36-49%
    (results/issue14-targets/explore-s8c)."""
    base = centroidkv_safe().replace(query_window=SAFE_WINDOW)
    return _fitted(base, "centroidkv-safe-fitted", fitted_merger(reference_queries=SAFE_WINDOW))


@register_preset("semanticache-fitted")
def semanticache_fitted() -> PipelineConfig:
    return _fitted(semanticache_fixed64(), "semanticache-fitted")


@register_preset("semanticache-safe-fitted")
def semanticache_safe_fitted() -> PipelineConfig:
    return _fitted(semanticache_safe(), "semanticache-safe-fitted")


@register_preset("kvzip-csm-fitted")
def kvzip_csm_fitted() -> PipelineConfig:
    """kvzip-csm's clusters (important sentences exact, the rest CSM-merged), slots fitted once to
    the layer's last 32 queries (its SnapKV window). Fitted to the reconstruction pass's queries
    instead, every round, KL at keep 0.25 fell by 14-30% only; the window, once, by 36-41%
    (results/issue14-targets/explore-s8b)."""
    return _fitted(kvzip_csm(), "kvzip-csm-fitted")
