"""One registry per strategy kind, filled by decorators and by third-party entry points.

    @register_clusterer("gsc")
    @dataclass(frozen=True)
    class GreedySeedClustering: ...

Third-party packages declare, in their own pyproject.toml,

    [project.entry-points."kvcompress.strategies"]
    my_pkg = "my_pkg.strategies"          # a module whose import registers strategies

and the registries import them on the first lookup or listing; the user imports nothing.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import inspect
import logging
import threading
from typing import Any, Callable, Generic, Mapping, TypeVar

from .validation import require

ENTRY_POINT_GROUP = "kvcompress.strategies"
_log = logging.getLogger(__name__)

T = TypeVar("T")


class Registry(Generic[T]):
    """Named factories of one strategy kind ("chunker", "clusterer", ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: register a class or factory under an explicit name."""
        require(isinstance(name, str) and name.strip() == name and name != "",
                f"{self.kind} name", name, "a non-empty string without surrounding spaces")

        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries and self._entries[name] is not factory:
                raise ValueError(
                    f"{self.kind} name {name!r} is already registered "
                    f"(by {_qualname(self._entries[name])}); choose another name"
                )
            self._entries[name] = factory
            try:
                factory.registry_name = name  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            return factory

        return decorator

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._entries:
            load_plugins()
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise ValueError(f"{self.kind}={name!r} is not a registered {self.kind}: known {self.kind}s are {known}")
        return self._entries[name]

    def create(self, name: str, params: Mapping[str, Any] | None = None) -> T:
        """Instantiate ``name`` with ``params``; unknown parameter names are a ValueError."""
        factory = self.get(name)
        params = dict(params or {})
        allowed = _parameter_names(factory)
        unknown = sorted(set(params) - allowed) if allowed is not None else []
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} got unknown parameter(s) {unknown}: "
                f"allowed are {sorted(allowed)}"
            )
        return factory(**params)

    def list(self, pattern: str = "*") -> list[str]:
        """Registered names matching a glob pattern, sorted."""
        load_plugins()
        return sorted(n for n in self._entries if fnmatch.fnmatchcase(n, pattern))

    def __contains__(self, name: str) -> bool:
        return name in self.list()

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"


def _parameter_names(factory: Callable) -> set[str] | None:
    """Keyword parameters a factory accepts; None when it takes **kwargs or cannot be inspected."""
    if dataclasses.is_dataclass(factory):
        return {f.name for f in dataclasses.fields(factory) if f.init}
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {n for n, p in sig.parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


CHUNKERS: Registry = Registry("chunker")
CLUSTERERS: Registry = Registry("clusterer")
MERGERS: Registry = Registry("merger")
SCORERS: Registry = Registry("scorer")  # per-slot importance, for eviction and guards
GUARDS: Registry = Registry("guard")  # masks of slots that must never be merged or dropped

REGISTRIES: dict[str, Registry] = {
    "chunker": CHUNKERS,
    "clusterer": CLUSTERERS,
    "merger": MERGERS,
    "scorer": SCORERS,
    "guard": GUARDS,
}

register_chunker = CHUNKERS.register
register_clusterer = CLUSTERERS.register
register_merger = MERGERS.register
register_scorer = SCORERS.register
register_guard = GUARDS.register


def list_strategies(pattern: str = "*") -> dict[str, list[str]]:
    """{kind: [names]} for every kind, filtered by a glob pattern on the name."""
    return {kind: reg.list(pattern) for kind, reg in REGISTRIES.items()}


_plugins_loaded = False
_plugin_lock = threading.RLock()


def load_plugins(force: bool = False) -> list[str]:
    """Import every entry point of the ``kvcompress.strategies`` group once.

    Returns the names of the entry points loaded by this call. A plugin that fails to import
    is logged and skipped, so one broken package cannot break the library.
    """
    global _plugins_loaded
    with _plugin_lock:
        if _plugins_loaded and not force:
            return []
        _plugins_loaded = True
        importlib.import_module("kvcompress.strategies")  # built-ins first
        importlib.import_module("kvcompress.presets")
        from importlib.metadata import entry_points

        loaded = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
                if callable(obj) and not isinstance(obj, type):
                    obj()  # a register() function
                loaded.append(ep.name)
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the library
                _log.warning("kvcompress plugin %r failed to load: %s", ep.name, exc)
        return loaded
