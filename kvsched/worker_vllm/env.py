"""The worker's `KVSCHED_VLLM_*` environment variables, read the same way: a bad value is a
ValueError naming the variable and what it takes (the daemon ignores these variables)."""

from __future__ import annotations

import os


def switch(name: str, default: bool, on: str, off: str) -> bool:
    """A "1" / "0" variable; `on` / `off` say what each means (for the error)."""
    raw = os.environ.get(name, "1" if default else "0")
    if raw not in ("0", "1"):
        default_on, default_off = (", the default", "") if default else ("", ", the default")
        raise ValueError(f"{name} must be 1 ({on}{default_on}) or 0 ({off}{default_off})")
    return raw == "1"


def number(name: str, default: str, high: float, unit: str, integer: bool = False) -> float:
    """A number of `unit` in [0, high] (an integer when `integer`)."""
    raw = os.environ.get(name, default)
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit}, got {raw!r}") from None
    if not 0 <= value <= high:
        raise ValueError(f"{name} must be in [0, {high:g}] {unit}, got {raw!r}")
    return value
