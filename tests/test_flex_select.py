"""The backend chooser of kvcompress.flex (no compilation: flex is replaced where it would run)."""

from __future__ import annotations

import pytest
import torch

from kvcompress import flex
from kvcompress.attention import proportional_attention

from test_flex_score_mods import random_inputs


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.delenv("KVCOMPRESS_ATTENTION", raising=False)
    flex.set_backend(None)
    flex.clear_backend_decisions()
    yield
    flex.set_backend(None)
    flex.clear_backend_decisions()


def test_device_rules():
    assert flex.chooser._rule("cuda", (64, 64)) == "sdpa"  # flex does not split the keys on CUDA decode
    assert flex.chooser._rule("cuda", (16, 16)) == "sdpa"
    assert flex.chooser._rule("mps", (64, 64)) == "sdpa"
    assert flex.chooser._rule("cpu", (16, 64)) == "sdpa"
    assert flex.chooser._rule("cpu", (64, 16)) == "sdpa"
    assert flex.chooser._rule("cpu", (64, 64)) is None  # probe


def test_override_and_environment(monkeypatch):
    q, k, v, ls = random_inputs(1, 4, 2, 1, 10, 32)
    flex.set_backend("flex")
    assert flex.choose_backend(q, k, v, ls) == "flex"
    flex.set_backend(None)
    monkeypatch.setenv("KVCOMPRESS_ATTENTION", "sdpa")
    assert flex.get_backend_override() == "sdpa"
    assert flex.choose_backend(q, k, v, ls) == "sdpa"
    monkeypatch.setenv("KVCOMPRESS_ATTENTION", "auto")
    assert flex.get_backend_override() is None
    monkeypatch.setenv("KVCOMPRESS_ATTENTION", "triton")
    with pytest.raises(ValueError, match="KVCOMPRESS_ATTENTION"):
        flex.choose_backend(q, k, v, ls)
    with pytest.raises(ValueError, match="backend"):
        flex.set_backend("eager")
    assert flex.backend_decisions() == {}  # overrides never probe


def test_explicit_sdpa_backend_is_the_reference():
    q, k, v, ls = random_inputs(2, 6, 3, 3, 12, 16, pad=2, seed=3)
    out = flex.auto_proportional_attention(q, k, v, ls, backend="sdpa", scale=0.2)
    torch.testing.assert_close(out, proportional_attention(q, k, v, ls, scale=0.2))
    with pytest.raises(ValueError, match="backend"):
        flex.auto_proportional_attention(q, k, v, ls, backend="math")


def test_small_cpu_head_dims_use_sdpa_without_probing(monkeypatch):
    monkeypatch.setattr(flex.chooser, "_probe", lambda *a: pytest.fail("probed"))
    q, k, v, ls = random_inputs(1, 4, 2, 1, 10, 16)
    out = flex.auto_proportional_attention(q, k, v, ls)
    torch.testing.assert_close(out, proportional_attention(q, k, v, ls))


def test_probe_runs_once_per_bucket(monkeypatch):
    calls = []

    def fake_probe(query, keys, values, log_sizes, kwargs):
        calls.append(keys.shape[2])
        return flex.BackendDecision("sdpa", "probe", 2.0, 1.0)

    monkeypatch.setattr(flex.chooser, "_probe", fake_probe)
    q, k, v, ls = random_inputs(1, 4, 2, 1, 300, 32)
    for n in (300, 301, 400, 512):  # one bucket: N in (256, 512]
        assert flex.choose_backend(q, k[:, :, :n], v[:, :, :n], ls[:, :, :n]) == "sdpa"
    assert calls == [300]
    k2, v2, ls2 = (torch.cat([t, t], dim=2) for t in (k, v, ls))
    flex.choose_backend(q, k2, v2, ls2)  # N = 600: next bucket
    flex.choose_backend(q.expand(1, 4, 3, 32), k, v, ls)  # L = 3: another bucket
    flex.choose_backend(q.double(), k.double(), v.double(), ls)  # another dtype
    assert calls == [300, 600, 300, 300]
    keys = list(flex.backend_decisions())
    assert {key[-1] for key in keys} == {512, 1024} and {key[-2] for key in keys} == {1, 4}
    # Without values and log_sizes nothing is probed or cached.
    assert flex.choose_backend(q, torch.zeros(1, 2, 5000, 32)) == "sdpa"
    assert calls == [300, 600, 300, 300]


def test_probe_keeps_sdpa_when_flex_fails_or_disagrees(monkeypatch):
    q, k, v, ls = random_inputs(1, 4, 2, 1, 20, 32)

    def broken(*a, **kw):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(flex.chooser, "flex_proportional_attention", broken)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        decision = flex.chooser._probe(q, k, v, ls, {})
    assert (decision.backend, decision.reason) == ("sdpa", "flex failed")

    monkeypatch.setattr(flex.chooser, "flex_proportional_attention",
                        lambda *a, **kw: flex.sdpa_proportional_attention(*a, **kw) + 0.1)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        decision = flex.chooser._probe(q, k, v, ls, {})
    assert (decision.backend, decision.reason) == ("sdpa", "flex disagreed")

    # Agreeing and faster: flex wins. A fake clock that each backend advances makes the
    # timing deterministic.
    clock = [0.0]
    real_sdpa = flex.sdpa_proportional_attention

    def timed_backend(cost):
        def run(*a, **kw):
            clock[0] += cost
            return real_sdpa(*a, **kw)
        return run

    monkeypatch.setattr(flex.chooser.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(flex.chooser, "flex_proportional_attention", timed_backend(0.001))
    monkeypatch.setattr(flex.chooser, "sdpa_proportional_attention", timed_backend(0.003))
    decision = flex.chooser._probe(q, k, v, ls, {})
    assert decision == flex.BackendDecision("flex", "probe", pytest.approx(1.0), pytest.approx(3.0))
    monkeypatch.setattr(flex.chooser, "flex_proportional_attention", timed_backend(0.005))
    assert flex.chooser._probe(q, k, v, ls, {}).backend == "sdpa"


def test_each_chooser_keeps_its_own_decisions_and_override(monkeypatch):
    """Two owners (e.g. two caches) never share probe results or overrides."""
    calls = []

    def fake_probe(query, keys, values, log_sizes, kwargs):
        calls.append(len(calls))
        return flex.BackendDecision("sdpa", "probe", 2.0, 1.0)

    a, b = flex.BackendChooser(probe=fake_probe), flex.BackendChooser(probe=fake_probe)
    q, k, v, ls = random_inputs(1, 4, 2, 1, 300, 32)
    assert a.choose(q, k, v, ls) == "sdpa" and b.choose(q, k, v, ls) == "sdpa"
    assert calls == [0, 1] and len(a.decisions()) == len(b.decisions()) == 1
    assert flex.backend_decisions() == {}  # the default chooser saw nothing
    a.override = "flex"
    assert a.choose(q, k, v, ls) == "flex" and b.choose(q, k, v, ls) == "sdpa"
    a.clear()
    assert a.decisions() == {} and len(b.decisions()) == 1
    with pytest.raises(ValueError, match="backend"):
        flex.BackendChooser(override="eager")
