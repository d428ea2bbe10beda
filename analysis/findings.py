"""Findings: what the detectors conclude, in one shape for JSON, DataFrames and reports.

`{"schema": FINDINGS_SCHEMA, "findings": [...]}` is documented in docs/findings.md.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

FINDINGS_SCHEMA = 1


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
