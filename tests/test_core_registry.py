"""Registries: explicit names, helpful errors, glob listing, parameter checks, entry-point plugins."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import pytest

from kvcompress import registry
from kvcompress.registry import CHUNKERS, CLUSTERERS, MERGERS, Registry, list_strategies, load_plugins


@pytest.fixture
def scratch():
    reg = Registry("widget")
    yield reg


def test_duplicate_names_are_rejected(scratch):
    @scratch.register("a")
    @dataclass(frozen=True)
    class A:
        x: int = 1

    scratch.register("a")(A)  # the same factory again is harmless
    with pytest.raises(ValueError, match="'a' is already registered"):
        @scratch.register("a")
        class B:
            pass


def test_names_must_be_clean_strings(scratch):
    for bad in ("", " a", 3):
        with pytest.raises(ValueError, match="widget name"):
            scratch.register(bad)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        CLUSTERERS.get("no-such-clusterer")
    msg = str(info.value)
    assert "no-such-clusterer" in msg and "gsc" in msg
    with pytest.raises(ValueError, match="delimiter"):
        CHUNKERS.get("sentences")


def test_list_with_glob_patterns():
    assert CLUSTERERS.list("gs?") == ["gsc"]
    assert {"delimiter", "fixed", "global"} <= set(CHUNKERS.list())
    assert set(CHUNKERS.list("g*")) >= {"global"} and "fixed" not in CHUNKERS.list("g*")
    assert MERGERS.list("mea[n]") == ["mean"]
    assert CHUNKERS.list("zzz*") == []
    listed = list_strategies("gsc")
    assert listed["clusterer"] == ["gsc"] and listed["chunker"] == []
    assert "gsc" in CLUSTERERS


def test_unknown_params_are_rejected_with_the_allowed_ones():
    with pytest.raises(ValueError) as info:
        CLUSTERERS.create("gsc", {"tau": 0.5, "thresh": 1})
    msg = str(info.value)
    assert "thresh" in msg and "tau" in msg and "search_width" in msg
    assert CLUSTERERS.create("gsc", {"tau": 0.5}).tau == 0.5


def test_plugins_load_from_entry_points(monkeypatch):
    calls = []

    @dataclass(frozen=True)
    class PluginClusterer:
        strength: float = 1.0

    def register():  # what a plugin's entry point may name: a register() function
        CLUSTERERS.register("plugin-clusterer")(PluginClusterer)
        calls.append("registered")

    class FakeEntryPoint:
        name = "fake-plugin"

        def load(self):
            return register

    class BrokenEntryPoint:
        name = "broken-plugin"

        def load(self):
            raise ImportError("missing dependency")

    def fake_entry_points(group=None, **kw):
        assert group == registry.ENTRY_POINT_GROUP
        return [FakeEntryPoint(), BrokenEntryPoint()]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    try:
        # a lookup of an unknown name triggers plugin loading; the broken plugin is skipped
        clusterer = CLUSTERERS.create("plugin-clusterer", {"strength": 2.0})
        assert clusterer.strength == 2.0 and calls == ["registered"]
        assert "plugin-clusterer" in CLUSTERERS.list("plugin-*")
        assert load_plugins() == []  # once only
        assert load_plugins(force=True) == ["fake-plugin"] and len(calls) == 2
    finally:
        CLUSTERERS.unregister("plugin-clusterer")
    assert "plugin-clusterer" not in CLUSTERERS.list()


def test_unknown_params_of_a_plain_factory_are_a_value_error(scratch):
    @scratch.register("fn")
    def make(size: int = 2, *, mode: str = "a"):
        return (size, mode)

    assert scratch.create("fn", {"size": 3, "mode": "b"}) == (3, "b")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['bogus'\]"):
        scratch.create("fn", {"bogus": 1})
