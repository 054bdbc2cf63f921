"""Methods under evaluation: a preset (or pipeline JSON) plus overrides, at a budget.

A method spec is ``PRESET`` or ``PRESET:KEY=VALUE,KEY=VALUE`` (values parsed as JSON, else taken
as strings), e.g. ``semanticache:clusterer.tau=0.9`` or ``centroidkv:proportional_attention=false``.
Its label is the spec itself, so two variants of one preset stay apart in the results.

Every method runs with ``on_infeasible="best_effort"``: a budget the method cannot reach gives the
smallest cache it can reach, and the results record the achieved keep and ``budget_met=False``.
The preset "full" (no compression) runs once per sample and protocol, at budget 1.0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..config import PipelineConfig, as_config
from ..config import parse_overrides as parse_config_overrides
from ..pipeline import Pipeline
from ..presets import list_presets
from ..validation import check_range, require

FULL = "full"
_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w.]*\s*=)")

# one command per ablation (issue 6, item 4): methods and the budgets used when none are given
ABLATIONS = {
    "chunking": (("full", "semanticache", "semanticache-fixed64", "semanticache-global"), (0.75, 0.5, 0.25)),
    "proportional": (("full", "semanticache", "semanticache:proportional_attention=false", "centroidkv",
                      "centroidkv:proportional_attention=false"), (0.75, 0.5, 0.25)),
    # fixed thresholds, no budget pressure (keep_ratio 1.0): achieved compression vs accuracy
    "tau": (("full",) + tuple(f"semanticache:clusterer.tau={t}" for t in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95))
            + tuple(f"semanticache-fixed64:clusterer.tau={t}" for t in (0.5, 0.7, 0.9)), (1.0,)),
    "csm-chunk": (("full", "centroidkv-chunk16", "centroidkv-chunk64", "centroidkv-chunk256"), (0.75, 0.5, 0.25)),
    # issue 9: which signal of the sentence guard does the work (run with --protocols agnostic,aware)
    "guards": (("full", "semanticache-fixed64", "semanticache-safe")
               + tuple(f'semanticache-safe:guards=[{{"name":"sentences","params":{{"signals":["{s}"]}}}}]'
                       for s in ("query", "literal", "novelty")), (0.5, 0.25)),
}


def parse_overrides(items) -> dict:
    """["key=value", ...] -> {key: parsed value}."""
    return parse_config_overrides(items, "override")


@dataclass(frozen=True)
class Method:
    """preset: a preset name or pipeline JSON path; overrides: ((key, value), ...) sorted by key."""

    label: str
    preset: str
    overrides: tuple = ()

    @classmethod
    def parse(cls, spec: str, extra: dict | None = None) -> "Method":
        require(isinstance(spec, str) and spec.strip() != "", "method", spec, "PRESET or PRESET:KEY=VALUE,...")
        spec = spec.strip()
        preset, _, rest = spec.partition(":")
        own = parse_overrides([p for p in _SPLIT.split(rest) if p.strip()]) if rest else {}
        added = {k: v for k, v in (extra or {}).items() if k not in own}
        overrides = {**added, **own}
        label = spec
        if added:
            label += ("," if rest else ":") + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(added.items()))
        method = cls(label=label, preset=preset.strip(), overrides=tuple(sorted(overrides.items())))
        Pipeline(method.config(0.5))  # unknown presets, bad overrides and strategy params fail here,
        # before any model work
        return method

    @property
    def is_full(self) -> bool:
        return self.preset == FULL and not self.overrides

    def config(self, budget: float) -> PipelineConfig:
        """The pipeline at keep ratio ``budget``, best effort when the budget is out of reach."""
        check_range("budget", budget, 0.0, 1.0, lo_open=True)
        overrides = dict(self.overrides)
        if not self.is_full:
            overrides.update(keep_ratio=budget, max_slots=None)
        overrides["on_infeasible"] = "best_effort"
        return as_config(self.preset, **overrides)

    def budgets(self, budgets) -> tuple[float, ...]:
        return (1.0,) if self.is_full else tuple(budgets)


def parse_methods(presets: str | None = None, methods=None, overrides=None,
                  ablation: str | None = None) -> list[Method]:
    """Methods from ``--presets a,b`` (or "all"), ``--method SPEC`` entries and an ``--ablation``;
    ``overrides`` (a dict) applies to every method but "full". Order kept, duplicates removed."""
    specs: list[str] = []
    if ablation is not None:
        require(ablation in ABLATIONS, "ablation", ablation, f"one of {sorted(ABLATIONS)}")
        specs += list(ABLATIONS[ablation][0])
    if presets:
        names = [p.strip() for p in presets.split(",") if p.strip()]
        if names == ["all"]:
            names = [FULL] + [p for p in list_presets() if p != FULL]
        specs += names
    specs += list(methods or ())
    require(bool(specs), "presets", presets, "at least one preset (--presets, --method or --ablation)")
    out, seen = [], set()
    for spec in specs:
        extra = None if spec.strip() == FULL else (overrides or None)
        try:
            method = Method.parse(spec, extra)
        except ValueError as exc:  # name the method (and the overrides applied to it)
            added = "" if not extra else " with --override " + ",".join(f"{k}={v!r}" for k, v in extra.items())
            raise ValueError(f"method {spec.strip()!r}{added}: {exc}") from None
        if method.label not in seen:
            seen.add(method.label)
            out.append(method)
    return out


def parse_floats(text: str | None, what: str, lo: float = 0.0, hi: float = 1.0, lo_open: bool = True) -> tuple:
    require(isinstance(text, str) and text.strip() != "", what, text, "a comma-separated list of numbers")
    values = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"{what}={text!r} is invalid: expected comma-separated numbers") from None
        check_range(what, v, lo, hi, lo_open=lo_open)
        values.append(v)
    return tuple(values)


def parse_ints(text: str | None, what: str, lo: int = 1) -> tuple:
    require(isinstance(text, str) and text.strip() != "", what, text, "a comma-separated list of integers")
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            v = int(float(part[:-1]) * mult) if mult > 1 else int(part)
        except ValueError:
            raise ValueError(f"{what}={text!r} is invalid: expected comma-separated integers (2048 or 2k)") from None
        require(v >= lo, what, v, f"integers >= {lo}")
        values.append(v)
    return tuple(values)
