"""The baselines the papers compare against, as presets of the same pipeline (docs/strategies.md).

Every preset keeps the library's budget semantics (keep_ratio of each row's tokens, or max_slots
per head) and sets the attention statistics its scorers need (query_window, track_attention).
"""

from ..config import PipelineConfig, StrategySpec
from . import register_preset

DEFAULT_KEEP_RATIO = 0.5
STREAMING_SINKS = 4  # StreamingLLM's attention sinks; the recent window is budget - sinks
SNAPKV_WINDOW = 32  # SnapKV's observation window (also kept as the recent window)
SNAPKV_KERNEL = 7  # SnapKV's pooling kernel (max pooling)
H2O_WINDOW = 64  # prompt queries scoring H2O's heavy hitters at prefill
H2O_RECENT_SHARE = 0.5  # H2O: half heavy hitters, half recent tokens
CAM_SPAN = 32  # CaM's merge budget: kept values an evicted value is spread over
CAM_WINDOW = 32  # queries scoring CaM's merge probability at prefill
D2O_BETA = 0.7  # EMA weight of D2O's similarity threshold


@register_preset("full")
def full() -> PipelineConfig:
    """No compression: every slot is kept and the state is returned as it is (the reference)."""
    return PipelineConfig(
        name="full", keep_ratio=1.0, sinks=0, recent=0,
        chunker=StrategySpec("global"), clusterer=StrategySpec("keep"), merger=StrategySpec("identity"),
    )


def _evict(name: str, scorer: dict, **fields) -> PipelineConfig:
    base = dict(name=name, keep_ratio=DEFAULT_KEEP_RATIO, sinks=0, recent=0, chunker=StrategySpec("global"),
                merger=StrategySpec("mean"))
    params = {"scorer": scorer, "recent_share": fields.pop("recent_share", 0.0)}
    return PipelineConfig(**{**base, **fields, "clusterer": StrategySpec("evict", params)})


@register_preset("streamingllm")
def streamingllm() -> PipelineConfig:
    """StreamingLLM (Xiao et al., 2024): attention sinks + the most recent tokens. The recent window
    is whatever the budget leaves after the sinks (budget = sinks + window); with recent=R and a
    budget of sinks + R exactly the protected sinks and R recent tokens remain."""
    return _evict("streamingllm", {"name": "recency"}, sinks=STREAMING_SINKS)


@register_preset("h2o")
def h2o() -> PipelineConfig:
    """H2O (Zhang et al., 2023): half heavy hitters by accumulated attention, half recent tokens."""
    return _evict("h2o", {"name": "h2o"}, recent_share=H2O_RECENT_SHARE,
                  query_window=H2O_WINDOW, track_attention=True)


@register_preset("snapkv")
def snapkv() -> PipelineConfig:
    """SnapKV (Li et al., 2024): attention from the last 32 prompt queries, max-pooled (kernel 7),
    plus the observation window itself."""
    scorer = {"name": "snapkv", "params": {"kernel_size": SNAPKV_KERNEL, "pooling": "max"}}
    return _evict("snapkv", scorer, recent=SNAPKV_WINDOW, query_window=SNAPKV_WINDOW)


@register_preset("knorm")
def knorm() -> PipelineConfig:
    """Key-norm (Devoto et al., 2024): keep the keys with the lowest L2 norm."""
    return _evict("knorm", {"name": "knorm"})


def _cam(name: str, proportional: bool) -> PipelineConfig:
    return PipelineConfig(
        name=name, keep_ratio=DEFAULT_KEEP_RATIO, sinks=STREAMING_SINKS, recent=0,
        chunker=StrategySpec("global"),
        clusterer=StrategySpec("cam", {"scorer": {"name": "recency"}, "merge_scorer": {"name": "attention", "params": {"reduce": "mean"}},
                                       "span": CAM_SPAN, "merge_rule": "bernoulli", "seed": 0}),
        merger=StrategySpec("cam", {"proportional": proportional}),
        query_window=CAM_WINDOW, proportional_attention=proportional,
    )


@register_preset("cam")
def cam() -> PipelineConfig:
    """CaM (Zhang et al., ICML 2024) on a StreamingLLM cache, as the paper: evicted values are
    added to the next kept values with probability from their relative attention; no sizes."""
    return _cam("cam", proportional=False)


@register_preset("cam-prop")
def cam_prop() -> PipelineConfig:
    """CaM with sizes: size-weighted merging and proportional attention."""
    return _cam("cam-prop", proportional=True)


def _d2o(name: str, proportional: bool) -> PipelineConfig:
    return PipelineConfig(
        name=name, keep_ratio=DEFAULT_KEEP_RATIO, sinks=0, recent=0, chunker=StrategySpec("global"),
        clusterer=StrategySpec("d2o", {"scorer": {"name": "h2o"}, "recent_share": H2O_RECENT_SHARE}),
        merger=StrategySpec("d2o", {"threshold": None, "beta": D2O_BETA, "proportional": proportional}),
        query_window=H2O_WINDOW, track_attention=True, proportional_attention=proportional,
    )


@register_preset("d2o")
def d2o() -> PipelineConfig:
    """D2O (Wan et al., 2024), token level: H2O eviction, evicted tokens merged into their most
    similar kept token above an EMA threshold with similarity weights; no sizes."""
    return _d2o("d2o", proportional=False)


@register_preset("d2o-prop")
def d2o_prop() -> PipelineConfig:
    """D2O with sizes: size-and-similarity-weighted merging and proportional attention."""
    return _d2o("d2o-prop", proportional=True)
