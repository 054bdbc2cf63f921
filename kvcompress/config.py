"""Pipeline configs: frozen dataclasses that round-trip through plain dicts and JSON.

    cfg = PipelineConfig.from_dict({
        "keep_ratio": 0.25,
        "chunker": {"name": "delimiter"},
        "clusterer": {"name": "gsc"},
        "merger": {"name": "mean"},
    })
    assert PipelineConfig.from_json(cfg.to_json()) == cfg
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .validation import check_choice, check_int, check_range, require


def _freeze(value: Any) -> Any:
    """Lists become tuples so configs stay hashable and compare equal after a JSON trip."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _freeze(v) for k, v in value.items()}
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy by name plus its parameters."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        require(isinstance(self.name, str) and self.name != "", "name", self.name, "a registered strategy name")
        require(isinstance(self.params, Mapping), "params", self.params, "a dict of parameters")
        object.__setattr__(self, "params", _freeze(dict(self.params)))

    def __hash__(self):
        return hash((self.name, json.dumps(_thaw(self.params), sort_keys=True, default=str)))

    @classmethod
    def coerce(cls, value: "StrategySpec | Mapping | str", what: str) -> "StrategySpec":
        if isinstance(value, StrategySpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping):
            extra = sorted(set(value) - {"name", "params"})
            require(not extra, what, dict(value), "a dict with keys 'name' and optional 'params'")
            require("name" in value, what, dict(value), "a dict with a 'name' key")
            return cls(value["name"], value.get("params", {}))
        raise ValueError(f"{what}={value!r} is invalid: expected a strategy name, a dict or a StrategySpec")

    def to_dict(self) -> dict:
        return {"name": self.name, "params": _thaw(self.params)}


STAGES = ("chunker", "clusterer", "merger", "fallback_chunker")  # the "stage.param" override prefixes
INFEASIBLE_POLICIES = ("warn", "best_effort", "error")
DEFAULT_KEEP_RATIO = 0.5


@dataclass(frozen=True)
class PipelineConfig:
    """protection (sinks, recent window, guards, anchors) -> chunker -> clusterer -> merger.

    Budget: exactly one of ``keep_ratio`` (fraction of each row's tokens kept, in (0, 1]) or
    ``max_slots`` (a slot count per head); with neither given, keep_ratio is 0.5.
    """

    name: str = "custom"
    keep_ratio: float | None = None  # None with max_slots None: DEFAULT_KEEP_RATIO
    max_slots: int | None = None
    sinks: int = 4
    recent: int = 0
    chunker: StrategySpec = field(default_factory=lambda: StrategySpec("global"))
    # chunker for the heads whose budget lies below what ``chunker`` can reach (None: no fallback)
    fallback_chunker: StrategySpec | None = None
    clusterer: StrategySpec = field(default_factory=lambda: StrategySpec("gsc"))
    merger: StrategySpec = field(default_factory=lambda: StrategySpec("mean"))
    guards: tuple[StrategySpec, ...] = ()
    max_rounds: int = 64
    # a budget out of reach: "warn" = smallest cache reached + one BudgetWarning, "best_effort" =
    # the same without the warning (results record it), "error" = BudgetError, nothing changed
    on_infeasible: str = "warn"
    proportional_attention: bool = True
    # decode-time: compress again when a layer exceeds its budget by this many slots (g)
    recompress_every: int = 64
    # (layer, kv_head) pairs that keep their full cache
    full_heads: tuple[tuple[int, int], ...] = ()
    # attention statistics the cache collects for scorers (H2O, SnapKV, ...):
    # the last `query_window` queries of each layer -> state.extras["queries"] [B, H_q, W, D]
    query_window: int = 0
    # accumulate the attention each slot receives while decoding -> state.extras["attn_acc"] [B, H_kv, N]
    track_attention: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "chunker", StrategySpec.coerce(self.chunker, "chunker"))
        if self.fallback_chunker is not None:
            set_(self, "fallback_chunker", StrategySpec.coerce(self.fallback_chunker, "fallback_chunker"))
        set_(self, "clusterer", StrategySpec.coerce(self.clusterer, "clusterer"))
        set_(self, "merger", StrategySpec.coerce(self.merger, "merger"))
        require(isinstance(self.guards, (list, tuple)), "guards", self.guards, "a list of strategy specs")
        set_(self, "guards", tuple(StrategySpec.coerce(g, "guards[]") for g in self.guards))
        require(isinstance(self.full_heads, (list, tuple)), "full_heads", self.full_heads, "a list of [layer, head] pairs")
        heads = []
        for pair in self.full_heads:
            ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
            require(ok, "full_heads[]", pair, "a [layer, head] pair of integers >= 0")
            heads.append((int(pair[0]), int(pair[1])))
        set_(self, "full_heads", tuple(heads))
        if self.keep_ratio is None and self.max_slots is None:
            # the default budget; a plain default of 0.5 would make PipelineConfig(max_slots=n) fail
            set_(self, "keep_ratio", DEFAULT_KEEP_RATIO)
        require((self.keep_ratio is None) != (self.max_slots is None), "keep_ratio/max_slots",
                (self.keep_ratio, self.max_slots), "exactly one of them set (the other None)")
        if self.keep_ratio is not None:
            check_range("keep_ratio", self.keep_ratio, 0.0, 1.0, lo_open=True)
        if self.max_slots is not None:
            check_int("max_slots", self.max_slots, 1)
        check_int("sinks", self.sinks, 0)
        check_int("recent", self.recent, 0)
        check_int("max_rounds", self.max_rounds, 1)
        check_int("recompress_every", self.recompress_every, 1)
        check_choice("on_infeasible", self.on_infeasible, INFEASIBLE_POLICIES)
        check_int("query_window", self.query_window, 0)
        require(isinstance(self.track_attention, bool), "track_attention", self.track_attention, "True or False")
        require(isinstance(self.proportional_attention, bool), "proportional_attention",
                self.proportional_attention, "True or False")

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, StrategySpec):  # chunker, ..., fallback_chunker when set
                value = value.to_dict()
            elif f.name == "guards":
                value = [g.to_dict() for g in value]
            elif f.name == "full_heads":
                value = [list(p) for p in value]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PipelineConfig":
        require(isinstance(data, Mapping), "config", data, "a dict")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - allowed)
        require(not unknown, "config keys", unknown, f"keys among {sorted(allowed)}")
        return cls(**dict(data))

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **({"indent": 2} | kwargs))

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "PipelineConfig":
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text).read_text()
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "PipelineConfig":
        """A copy with fields changed; strategy params can be given as 'clusterer.tau'."""
        nested: dict[str, dict] = {}
        flat = {}
        for key, value in changes.items():
            if "." in key:
                stage, param = key.split(".", 1)
                require(stage in STAGES, "override", key,
                        f"'<{'|'.join(STAGES)}>.<param>' or a PipelineConfig field")
                nested.setdefault(stage, {})[param] = value
            else:
                flat[key] = value
        if "chunker" in flat and "fallback_chunker" not in flat:
            flat["fallback_chunker"] = None  # a fallback backs up the chunker it was chosen for
        if ("keep_ratio" in flat) and "max_slots" not in flat and flat["keep_ratio"] is not None:
            flat["max_slots"] = None
        if ("max_slots" in flat) and "keep_ratio" not in flat and flat["max_slots"] is not None:
            flat["keep_ratio"] = None
        for stage, params in nested.items():
            current = flat.get(stage, getattr(self, stage))
            require(current is not None, "override", f"{stage}.{sorted(params)[0]}",
                    f"a parameter of a {stage} the config names (set {stage} first)")
            spec = StrategySpec.coerce(current, stage)
            flat[stage] = StrategySpec(spec.name, {**spec.params, **params})
        allowed = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(flat) - allowed)
        require(not unknown, "override", unknown, f"fields among {sorted(allowed)}")
        return dataclasses.replace(self, **flat)


def parse_overrides(items, flag: str = "--set", form: str = "KEY=VALUE") -> dict:
    """["recent=64", "clusterer.tau=0.9", "chunker=fixed"] -> {"recent": 64, ...}: values parsed as
    JSON, else kept as strings. The command-line form of ``as_config``'s overrides."""
    out = {}
    for item in items or ():
        require(isinstance(item, str) and "=" in item, flag, item,
                f"{form}, e.g. recent=16 or clusterer.tau=0.8 (a config field or stage.param)")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw.strip())
        except json.JSONDecodeError:
            out[key.strip()] = raw.strip()
    return out


def _config_file(path: Path) -> PipelineConfig:
    """A pipeline JSON file; a missing or malformed file is a ValueError naming it."""
    require(path.is_file(), "config", str(path), "a preset name or an existing pipeline JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"config={str(path)!r} is invalid: expected a readable pipeline JSON file ({exc})") from None
    return PipelineConfig.from_dict(data)


def as_config(config: "PipelineConfig | Mapping | str | Path", **overrides) -> PipelineConfig:
    """A preset name, a dict, a JSON file path or a config object, with overrides applied."""
    from .presets import get_preset

    if isinstance(config, PipelineConfig):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = PipelineConfig.from_dict(config)
    elif isinstance(config, Path) or (isinstance(config, str) and config.endswith(".json")):
        cfg = _config_file(Path(config))
    elif isinstance(config, str):
        cfg = get_preset(config)
    else:
        raise ValueError(f"config={config!r} is invalid: expected a preset name, a dict, a JSON path or a PipelineConfig")
    return cfg.replace(**overrides) if overrides else cfg
