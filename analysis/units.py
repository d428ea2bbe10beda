"""Human-readable durations for reports (sizes: sampler/units.py)."""

from __future__ import annotations


def fmt_hours(h: float) -> str:
    if h < 1:
        return f"{h * 60:.0f} min"
    if h < 48:
        return f"{h:.1f} h"
    return f"{h / 24:.1f} days"
