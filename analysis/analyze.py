"""Run every detector over a dataset: the `analyze` and `report` commands and the notebook API.

    from analysis import analyze
    ds = analyze.load("/var/tmp/prof")
    findings = analyze.run(ds)
    analyze.findings_frame(findings)      # a DataFrame, one row per finding
"""

from __future__ import annotations

from analysis.dataset import Dataset, load
from analysis.detect.arenas import detect_arena_bloat
from analysis.detect.families import by_family
from analysis.detect.gpu import detect_gpu
from analysis.detect.growth import classify_series, detect_growth
from analysis.detect.pymalloc import detect_pymalloc_bloat
from analysis.findings import Finding, to_dataframe, to_document

__all__ = ["load", "run", "findings_frame", "to_document", "classify_series", "detect_arena_bloat",
           "detect_pymalloc_bloat"]


def run(ds: Dataset) -> list[Finding]:
    """Every detector's findings, most severe first."""
    series = classify_series(ds)
    findings = (by_family(ds, detect_growth(ds, series)) + detect_arena_bloat(ds) + detect_pymalloc_bloat(ds)
                + detect_gpu(ds, series))
    return sorted(findings, key=lambda f: -f.severity)


def findings_frame(findings: list[Finding]):
    return to_dataframe(findings)
