"""Named presets: each is just a PipelineConfig; users override any field.

    get_preset("semanticache", keep_ratio=0.25, recent=32)

Method families register their presets in their own module of this package.
"""

from __future__ import annotations

import difflib
from typing import Callable

from ..config import PipelineConfig
from ..validation import require

_PRESETS: dict[str, Callable[[], PipelineConfig]] = {}


def register_preset(name: str):
    """Decorator for a zero-argument function returning the preset's PipelineConfig."""

    def decorator(fn: Callable[[], PipelineConfig]):
        if name in _PRESETS and _PRESETS[name] is not fn:
            raise ValueError(f"preset name {name!r} is already registered; choose another name")
        _PRESETS[name] = fn
        return fn

    return decorator


def list_presets(pattern: str = "*") -> list[str]:
    import fnmatch

    from ..registry import load_plugins

    load_plugins()
    return sorted(n for n in _PRESETS if fnmatch.fnmatchcase(n, pattern))


def get_preset(name: str, **overrides) -> PipelineConfig:
    """The preset's config, with overrides (fields, or 'clusterer.tau'-style strategy params)."""
    if name not in _PRESETS:
        from ..registry import load_plugins

        load_plugins()
    if name not in _PRESETS:
        close = difflib.get_close_matches(name, _PRESETS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        require(False, "preset", name, f"one of {sorted(_PRESETS)}{hint}")
    cfg = _PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg


from . import semanticache  # noqa: E402,F401  (built-in presets)
from . import centroidkv  # noqa: E402,F401
from . import baselines  # noqa: E402,F401
from . import fitted  # noqa: E402,F401  (issue 14)
from . import importance  # noqa: E402,F401
