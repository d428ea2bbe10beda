"""Run every detector over a dataset: the `analyze` and `report` commands and the notebook API.

    from analysis import analyze
    ds = analyze.load("/var/tmp/prof")
    findings = analyze.run(ds)
    analyze.findings_frame(findings)      # a DataFrame, one row per finding
"""

from __future__ import annotations

from analysis.dataset import READ_ATTEMPTS, Dataset, load
from analysis.detect import arenas, coverage, gpu, growth, pymalloc
from analysis.detect.arenas import detect_arena_bloat
from analysis.detect.coverage import detect_recording_incomplete
from analysis.detect.families import by_family
from analysis.detect.gpu import detect_gpu
from analysis.detect.growth import classify_series, detect_growth
from analysis.detect.pymalloc import detect_pymalloc_bloat
from analysis.findings import Finding, to_dataframe, to_document

__all__ = ["load", "run", "findings_frame", "to_document", "classify_series", "detect_arena_bloat",
           "detect_pymalloc_bloat"]


def run(ds: Dataset) -> list[Finding]:
    """Every detector's findings, most severe first. The stacks' series are read once, streamed
    (analysis/series.py); the detectors run on parts of whole processes (Dataset.parts), so that
    memory is bounded by a part's `processes` rows rather than the dataset's. A live daemon's
    compaction may replace files while they are streamed: then everything is read again."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return _run(ds)
        except FileNotFoundError:
            if attempt == READ_ATTEMPTS - 1:
                raise
            ds.forget()
    raise AssertionError("unreachable")


# what the detectors read of `processes`: a part holds only these
PART_COLUMNS = sorted({c for m in (arenas, coverage, gpu, growth, pymalloc) for c in m.PROCESS_COLUMNS})


def _run(ds: Dataset) -> list[Finding]:
    series = classify_series(ds)
    grown, others = [], []
    for part in ds.parts(columns=PART_COLUMNS):
        procs = part.processes[["recording_id", "pid"]].drop_duplicates() if part is not ds else None
        mine = series if procs is None or series.empty else series.merge(
            procs.astype({"recording_id": str, "pid": series["pid"].dtype}), on=["recording_id", "pid"])
        grown += detect_growth(part, mine)
        others += (detect_arena_bloat(part) + detect_pymalloc_bloat(part) + detect_gpu(part, mine)
                   + detect_recording_incomplete(part))
        del part, mine      # before the next part is read
    return sorted(by_family(ds, grown) + others, key=lambda f: -f.severity)


def findings_frame(findings: list[Finding]):
    return to_dataframe(findings)
