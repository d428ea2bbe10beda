"""Human-readable durations, times and rates for reports (sizes: sampler/units.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from sampler.units import fmt_bytes


def fmt_hours(h: float) -> str:
    if h < 1 / 60:
        return f"{h * 3600:.0f} s"
    if h < 1:
        return f"{h * 60:.0f} min"
    if h < 48:
        return f"{h:.1f} h"
    return f"{h / 24:.1f} days"


def fmt_rate(rate_h: float, stderr_h: float | None) -> str:
    """A rate per hour with its standard error, as the text prints it: an estimate is not a count."""
    return f"{fmt_bytes(rate_h)}/h" + (f" ± {fmt_bytes(stderr_h)}/h" if stderr_h is not None else "")


def fmt_duration(s: float) -> str:
    """Seconds in the unit that reads best, from `30 s` to `4.2 days`."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def fmt_utc(v: Any, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """A timestamp as UTC clock time (naive ones are taken as UTC); `–` when missing."""
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return "–"
    t = pd.Timestamp(v)
    t = t.tz_localize("UTC") if t.tzinfo is None else t.tz_convert("UTC")
    return t.strftime(fmt) + " UTC"
