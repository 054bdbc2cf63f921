"""CentroidKV (Chunked Soft Matching; first published as "Chelsea", arXiv 2506.11418) and its ablations.

Sinks (16), recent window (64) and chunk size (256) are the paper's defaults. The schedule values
are this library's choice (the paper leaves them open): r_init 0.5 (round 0 may merge every A
token), delta_r 0.1, floor 0.1; at keep-ratio 0.5 the budget is met in 2 rounds, at 0.25 in 3.
keep_ratio 0.5 matches the semanticache preset so the two compare at the same budget by default.
"""

from ..config import PipelineConfig, StrategySpec
from . import register_preset
from .semanticache import SAFE_QUERY_WINDOW, sentence_guard

CENTROIDKV_SINKS = 16
CENTROIDKV_RECENT = 64
CENTROIDKV_CHUNK = 256
CENTROIDKV_SCHEDULE = {"r_init": 0.5, "delta_r": 0.1, "r_min": 0.1}


def _centroidkv(name: str, chunk: int = CENTROIDKV_CHUNK, partition: str = "alternating",
                **schedule) -> PipelineConfig:
    return PipelineConfig(
        name=name,
        keep_ratio=0.5,
        sinks=CENTROIDKV_SINKS,
        recent=CENTROIDKV_RECENT,
        chunker=StrategySpec("csm", {"size": chunk}),
        clusterer=StrategySpec("csm", {**CENTROIDKV_SCHEDULE, **schedule, "partition": partition}),
        merger=StrategySpec("degree"),
    )


@register_preset("centroidkv")
def centroidkv() -> PipelineConfig:
    return _centroidkv("centroidkv")


@register_preset("centroidkv-chunk16")
def centroidkv_chunk16() -> PipelineConfig:
    """Ablation: chunks of 16 slots."""
    return _centroidkv("centroidkv-chunk16", chunk=16)


@register_preset("centroidkv-chunk64")
def centroidkv_chunk64() -> PipelineConfig:
    """Ablation: chunks of 64 slots."""
    return _centroidkv("centroidkv-chunk64", chunk=64)


@register_preset("centroidkv-chunk256")
def centroidkv_chunk256() -> PipelineConfig:
    """The default chunk size under an explicit name, to complete the 16 / 64 / 256 grid."""
    return _centroidkv("centroidkv-chunk256", chunk=256)


@register_preset("centroidkv-contiguous")
def centroidkv_contiguous() -> PipelineConfig:
    """Ablation: A = first half of each chunk, B = second half."""
    return _centroidkv("centroidkv-contiguous", partition="contiguous")


@register_preset("centroidkv-random")
def centroidkv_random() -> PipelineConfig:
    """Ablation: a seeded random half of each chunk is A."""
    return _centroidkv("centroidkv-random", partition="random")


@register_preset("centroidkv-fixed-r")
def centroidkv_fixed_r() -> PipelineConfig:
    """Ablation: schedule off, every round at r = r_init."""
    return _centroidkv("centroidkv-fixed-r", delta_r=0.0)


@register_preset("centroidkv-safe")
def centroidkv_safe() -> PipelineConfig:
    """CentroidKV with the sentence guard (see semanticache-safe)."""
    return _centroidkv("centroidkv-safe").replace(guards=(sentence_guard(),), query_window=SAFE_QUERY_WINDOW)
