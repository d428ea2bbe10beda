"""Collapsed stacks (`comm;outer;...;inner VALUE` per line) for flamegraph.pl, inferno, speedscope.

The root frame is the process name, so processes of one name merge; values are the rounded
estimates of one pprof sample type (see analysis.export.pprof).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from sampler.text import printable


def frame_name(f: dict[str, Any]) -> str:
    """Python frames as py-spy writes them, `function (file:line)`; native ones by function, or
    module+offset when unsymbolized (as the HTML flame graphs)."""
    fn = f.get("function")
    if f.get("kind") == "python":
        where = f"{f.get('file') or '?'}:{int(f['line'])}" if f.get("line") else str(f.get("file") or "?")
        name = f"{fn or '?'} ({where})"
    elif isinstance(fn, str) and fn:
        name = fn
    else:
        off = f.get("offset")
        name = f"{f.get('module') or '?'}+{int(off) & ((1 << 64) - 1):#x}" if off is not None else "[unknown]"
    return safe_frame(name)


def safe_frame(name: str) -> str:
    """One frame of a line: escaped (a newline would forge a line) and without ';' (a frame)."""
    return printable(name).replace(";", ":")


def collapsed_lines(values: pd.DataFrame, frames: dict[int, list[dict[str, Any]]], value: str) -> list[str]:
    """One line per distinct path with a positive value, heaviest first; `values` are
    `analysis.export.pprof.profile_values()` rows and `value` one of their sample types."""
    totals: dict[str, int] = {}
    for r in values.itertuples(index=False):
        stack = frames.get(int(r.stack_id))
        path = [frame_name(f) for f in reversed(stack)] if stack else ["[no stack]"]
        key = ";".join([safe_frame(str(r.comm)), *path])
        totals[key] = totals.get(key, 0) + round(getattr(r, value))
    return [f"{k} {v}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1]) if v > 0]
