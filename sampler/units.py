"""Sizes as people write them ("512K", "1.5G", "64MiB": powers of 1024) and as reports print them."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(?:i?b)?", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """Bytes in "512K", "1.5G", "64MiB", "4096"; None when it is not a size."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None:
        return None
    try:
        return int(float(m[1]) * _UNITS[m[2].lower()])
    except OverflowError:           # hundreds of digits: not a size either
        return None


def format_size(n: int) -> str:
    """The largest unit that divides n exactly, so that parse_size(format_size(n)) == n."""
    for unit in "PTGMK":
        if n and n % _UNITS[unit.lower()] == 0:
            return f"{n // _UNITS[unit.lower()]}{unit}"
    return str(n)


def fmt_bytes(n: float | None) -> str:
    """A size for people: "1.5 GiB", "512 B" ("?" for None)."""
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{n:.0f} B"
