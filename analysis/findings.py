"""Findings: what the detectors conclude, in one shape for JSON, DataFrames and reports.

`{"schema": FINDINGS_SCHEMA, "findings": [...]}` is documented in docs/findings.md.

A finding says itself: each kind is a subclass of `Finding` next to its detector
(analysis/detect/*.py) that fixes its `kind` and overrides what it shows beyond the common part
(`facts`, `next_step`, and where needed `stack`, `recommendation`, `numbers`, `to_json`). The
reports lay out what findings return and never look at `kind`: the terminal report
(analysis/report/text.py), the HTML report (analysis/report/html.py and its templates) and the
JSON (`to_document`, `to_dataframe`).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analysis.frames import Frame

FINDINGS_SCHEMA = 1
SHOWN_APART = ("frames", "recommendation", "recommendations")    # details that stack() and recommendation() show


@dataclass
class Finding:
    kind: str                 # persistent_growth | arena_bloat | ...
    pid: int
    comm: str
    severity: float           # ranking: higher is worse (0..100)
    confidence: float         # 0..1
    summary: str              # one human sentence
    details: dict[str, Any] = field(default_factory=dict)   # kind-specific fields

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, "pid": int(self.pid), "comm": self.comm,
               "severity": round(float(self.severity), 2), "confidence": round(float(self.confidence), 3),
               "summary": self.summary}
        out.update({k: _jsonable(v) for k, v in self.details.items()})
        return out

    # What the reports show of it, besides the kind, process, severity, confidence and summary.
    # The defaults read the common details; a kind overrides what it says in its own way.

    def facts(self) -> list[str]:
        """Its key numbers, one line each, under the summary in the terminal report."""
        return []

    def stack(self) -> list[Frame] | None:
        """The stack it blames, innermost first ([]: one without symbols), or None: no stack."""
        frames = self.details.get("frames")
        return frames if isinstance(frames, list) else None

    def numbers(self) -> dict[str, Any]:
        """The details shown as numbers beside the summary (the HTML report's chips; a `*_bytes`
        value's `*_stderr_bytes` goes beside it): all but those that stack() and recommendation() show."""
        return {k: v for k, v in self.details.items() if k not in SHOWN_APART}

    def recommendation(self) -> Any:
        """What to do, in full (the HTML report): a sentence, a list of them (nested lists nest) or
        dicts of fields; None without."""
        return self.details.get("recommendation", self.details.get("recommendations"))

    def next_step(self) -> str:
        """What to do next, true for its situation, in a few sentences for the terminal report;
        "" without."""
        return ""


def _jsonable(v: Any) -> Any:
    if isinstance(v, dt.datetime | pd.Timestamp):
        return pd.Timestamp(v).isoformat()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item") and not isinstance(v, list | dict | str):    # numpy scalars
        return _jsonable(v.item())
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def to_document(findings: list[Finding]) -> dict[str, Any]:
    ranked = sorted(findings, key=lambda f: -f.severity)
    return {"schema": FINDINGS_SCHEMA, "findings": [f.to_json() for f in ranked]}


def to_dataframe(findings: list[Finding]) -> pd.DataFrame:
    """One row per finding; kind-specific fields become columns (absent ones are NaN)."""
    rows = [f.to_json() for f in sorted(findings, key=lambda f: -f.severity)]
    return pd.DataFrame(rows)
