"""Input checks that raise ValueError naming the parameter, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor


def require(ok: bool, name: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError`` unless ``ok``: '<name>=<value> is invalid: expected <allowed>'."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {allowed}")


def check_range(
    name: str, value: float, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> None:
    """Raise unless lo <(=) value <(=) hi; the message shows the interval."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and not math.isnan(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    require(ok, name, value, f"a number in {interval}")


def check_int(name: str, value: Any, minimum: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    require(ok, name, value, f"an integer >= {minimum}")


def check_choice(name: str, value: Any, choices) -> None:
    require(value in choices, name, value, f"one of {sorted(choices)}")


def check_finite(name: str, t: Tensor) -> None:
    if not (t.is_floating_point() and t.numel()):
        return
    # a finite sum proves every element finite (NaN and inf propagate); only a non-finite sum,
    # which finite values may also give by overflowing, needs the element-wise check
    if bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all()):
        return
    bad = "NaN" if bool(torch.isnan(t).any()) else "inf"
    raise ValueError(f"{name} contains {bad}: expected finite values")


def check_same_device(tensors: Mapping[str, Tensor]) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        require(dev == first, f"{name}.device", str(dev), f"the device of {first_name} ({first})")
