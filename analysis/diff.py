"""Compare a baseline dataset with a new one, per process name and per stack: `allocsampler diff`,
the memory gate for CI and for before/after audits of an upgrade.

Stacks are matched by their symbolized frames (function and module, or function and file for
Python frames), never by stack_id or addresses, which change with every build and ASLR. Sampled
estimates are compared with their standard errors: a change counts when it exceeds Z standard
errors, so sampling noise neither fails a gate nor fills the list of changed stacks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.dataset import read_outstanding, read_table
from analysis.frames import read_stack_frames
from sampler.text import printable
from sampler.units import fmt_bytes, parse_size

DIFF_SCHEMA = 1
Z = 3.0                                    # standard errors a change of an estimate must exceed
SOURCES = ("malloc", "python", "mmap")
GPU_COLUMN = "gpu_reserved_bytes"          # a `processes` column, once the recorder writes one
METRICS = ("peak_rss", "peak_arena_resident", "peak_outstanding", "final_outstanding", "gpu_reserved")
_LABELS = {"peak_rss": "peak RSS", "peak_arena_resident": "peak arena resident",
           "peak_outstanding": "peak outstanding", "final_outstanding": "final outstanding",
           "gpu_reserved": "peak GPU reserved"}


@dataclass(frozen=True)
class Budget:
    """Allowed growth of a metric: a fraction of the baseline, or bytes."""

    relative: float | None = None
    absolute: float | None = None

    def allowed(self, baseline: float) -> float:
        if self.relative is not None:
            return baseline * (1 + self.relative)
        return baseline + (self.absolute or 0.0)

    def __str__(self) -> str:
        return f"{self.relative * 100:g}%" if self.relative is not None else fmt_bytes(self.absolute or 0)


def parse_budget(text: str) -> Budget:
    """`5%` (of the baseline) or a size (`64M`, `1G`, bytes)."""
    t = text.strip().lower()
    try:
        if t.endswith("%"):
            v = float(t[:-1]) / 100
            if v < 0 or not math.isfinite(v):
                raise ValueError
            return Budget(relative=v)
        v = parse_size(t)
        if v is None:
            raise ValueError
        return Budget(absolute=float(v))
    except ValueError:
        raise ValueError(f"not a budget: {text!r} (e.g. 5% or 64M)") from None


# --- one side ------------------------------------------------------------------------------------

# the part of a Python file's path that is the same in every virtual environment and prefix
_PY_LIB = re.compile(r".*/(?:site-packages|dist-packages|lib/python\d+(?:\.\d+)?t?)/")


def python_file(path: str) -> str:
    """`torch/nn/modules/module.py` for a library file, the file name otherwise, so that two
    checkouts or virtual environments at different paths still match."""
    m = _PY_LIB.match(path)
    return path[m.end():] if m else path.rsplit("/", 1)[-1]


def frame_label(f: dict[str, Any]) -> str:
    """A frame as matched across datasets: no address, so rebuilt binaries still match."""
    fn = f.get("function") or "?"
    if f.get("kind") == "python":
        return f"{fn} ({python_file(str(f.get('file') or f.get('path') or f.get('module') or '?'))})"
    return f"{fn} ({f.get('module') or '?'})"


def stack_key(frames: list[dict[str, Any]] | None) -> str:
    if not frames:
        return "[no stack]"
    labels: list[str] = []
    for f in frames:
        label = frame_label(f)
        if not (label.startswith("? (") and labels and labels[-1] == label):   # a run of unsymbolized
            labels.append(label)                                                # frames of one module
    return " < ".join(labels)


@dataclass
class Side:
    """What one dataset says, by process name."""

    procs: pd.DataFrame      # index comm: peak_rss, peak_arena_resident, gpu_reserved (NaN: not measured)
    totals: pd.DataFrame     # index (comm, source): peak, peak_var, final, final_var
    stacks: pd.DataFrame     # index (comm, source, key): the same
    has_gpu: bool            # the dataset measures GPU memory at all


def _last_ts(out: pd.DataFrame, procs: pd.DataFrame) -> pd.Series:
    # a snapshot in which a process held nothing has no outstanding rows, only a processes row
    both = pd.concat([out[["recording_id", "pid", "ts"]], procs[["recording_id", "pid", "ts"]]])
    return both.groupby(["recording_id", "pid"])["ts"].max().rename("last_ts")


def _peak_final(rows: pd.DataFrame, keys: list[str], last: pd.Series) -> pd.DataFrame:
    """Per key: the peak over snapshots of the summed estimate (processes of one name add up at
    one snapshot) and the final one (each process's last snapshot), with their variances. A
    dataset with several recordings gives the highest of them."""
    cols = ["peak", "peak_var", "final", "final_var"]
    if rows.empty:
        return pd.DataFrame(columns=cols, index=pd.MultiIndex.from_arrays([[]] * len(keys), names=keys))
    per_ts = rows.groupby(["recording_id", "ts", *keys])[["b", "var"]].sum().reset_index()
    peak = per_ts.loc[per_ts.groupby(keys)["b"].idxmax()].set_index(keys)[["b", "var"]]
    rows = rows.merge(last, left_on=["recording_id", "pid"], right_index=True)
    at_end = rows[rows["ts"] == rows["last_ts"]].groupby(["recording_id", *keys])[["b", "var"]].sum().reset_index()
    final = at_end.loc[at_end.groupby(keys)["b"].idxmax()].set_index(keys)[["b", "var"]]
    out = peak.join(final, lsuffix="_p", rsuffix="_f", how="outer").fillna(0.0)
    out.columns = cols
    return out


def load_side(root: str | Path) -> Side:
    out, _ = read_outstanding(root, columns=["ts", "recording_id", "pid", "comm", "source", "stack_id",  # running
                                             "outstanding_bytes", "outstanding_stderr_bytes"])
    procs = read_table(root, "processes")
    for df in (out, procs):     # plain strings: categoricals of two datasets do not compare
        for c in ("recording_id", "comm", "source"):
            if c in df:
                df[c] = df[c].astype(str)
    out = out[out["source"].isin(SOURCES)]
    out = out.assign(b=out["outstanding_bytes"], var=out["outstanding_stderr_bytes"] ** 2)
    frames = read_stack_frames(root)
    keys = {int(s): stack_key(frames.get(int(s))) for s in out["stack_id"].unique()}
    out["key"] = out["stack_id"].map(keys)
    last = _last_ts(out, procs)
    totals = _peak_final(out, ["comm", "source"], last)
    stacks = _peak_final(out, ["comm", "source", "key"], last)
    p = procs.assign(arena=procs["heap_rss"] + procs["arena_rss"],
                     gpu=procs[GPU_COLUMN] if GPU_COLUMN in procs else float("nan"))
    per_ts = p.groupby(["recording_id", "ts", "comm"])[["rss", "arena", "gpu"]].sum(min_count=1)
    peaks = per_ts.groupby("comm").max()
    peaks.columns = ["peak_rss", "peak_arena_resident", "gpu_reserved"]
    return Side(peaks, totals, stacks, bool(peaks["gpu_reserved"].notna().any()))


# --- comparison ----------------------------------------------------------------------------------

@dataclass
class Metric:
    name: str                   # one of METRICS
    source: str | None          # malloc | mmap for the outstanding metrics
    baseline: float | None      # None: not measured in that dataset (n/a)
    new: float | None
    stderr: float = 0.0         # of new - baseline; 0 for exact measurements (RSS)
    over_budget: bool = False

    @property
    def change(self) -> float | None:
        return None if self.baseline is None or self.new is None else self.new - self.baseline

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.name, "source": self.source, "baseline": _num(self.baseline), "new": _num(self.new),
                "change": _num(self.change), "stderr": _num(self.stderr), "over_budget": self.over_budget}


@dataclass
class StackChange:
    source: str
    status: str                 # grew | new | shrank | gone | grew_within_error
    stack: str                  # frames innermost first, `function (module)` joined by ` < `
    baseline_final: float
    new_final: float
    baseline_peak: float
    new_peak: float
    stderr: float               # of the change of the final estimate

    @property
    def change(self) -> float:
        return self.new_final - self.baseline_final

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "source": self.source, "stack": self.stack,
                "baseline_final_bytes": self.baseline_final, "new_final_bytes": self.new_final,
                "baseline_peak_bytes": self.baseline_peak, "new_peak_bytes": self.new_peak,
                "change_bytes": self.change, "stderr_bytes": self.stderr}


@dataclass
class ProcessDiff:
    comm: str
    presence: str               # both | new | gone
    metrics: list[Metric] = field(default_factory=list)
    stacks: list[StackChange] = field(default_factory=list)
    within_error_of: int = 0    # the stacks that grew within their error in the sources listed so

    @property
    def over_budget(self) -> bool:
        return any(m.over_budget for m in self.metrics)


@dataclass
class DiffReport:
    baseline: str
    new: str
    budget: Budget | None
    gated: tuple[str, ...]
    processes: list[ProcessDiff]

    @property
    def over_budget(self) -> bool:
        return any(p.over_budget for p in self.processes)

    def to_json(self) -> dict[str, Any]:
        return {"schema": DIFF_SCHEMA, "baseline": self.baseline, "new": self.new,
                "budget": str(self.budget) if self.budget else None, "gated_metrics": list(self.gated),
                "over_budget": self.over_budget,
                "processes": [{"comm": p.comm, "presence": p.presence, "over_budget": p.over_budget,
                               "metrics": [m.to_json() for m in p.metrics],
                               "stacks": [s.to_json() for s in p.stacks],
                               "grew_within_error_of": p.within_error_of} for p in self.processes]}


def _num(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _get(df: pd.DataFrame, idx: Any, col: str, default: float | None = 0.0) -> float | None:
    """The value, None where it is null (not measured), `default` where the row is absent."""
    if idx in df.index:
        v = df.at[idx, col]
        return float(v) if pd.notna(v) else None
    return default


def _process_metric(side: Side, comm: str, name: str) -> float | None:
    # a process that did not run used no memory; GPU memory is n/a, never a made-up 0, where the
    # dataset does not measure it
    absent = None if name == "gpu_reserved" and not side.has_gpu else 0.0
    return _get(side.procs, comm, name, absent)


def _stack_changes(source: str, base: pd.DataFrame, new: pd.DataFrame) -> list[StackChange]:
    """Stacks whose final or peak estimate changed by more than Z standard errors; then, as
    `grew_within_error`, the others whose final estimate grew (compare lists them only when
    their source is over budget and no stack of it passed Z: many small growths)."""
    both = base.join(new, lsuffix="_b", rsuffix="_n", how="outer").fillna(0.0)
    changes, within = [], []
    for key, r in both.iterrows():
        se_f = math.sqrt(r.final_var_b + r.final_var_n)
        se_p = math.sqrt(r.peak_var_b + r.peak_var_n)
        z = [(r.final_n - r.final_b) / se_f if se_f else 0.0, (r.peak_n - r.peak_b) / se_p if se_p else 0.0]
        if max(z) > Z:
            status = "new" if r.peak_b == 0 else "grew"
        elif min(z) < -Z:
            status = "gone" if r.peak_n == 0 else "shrank"
        else:
            if r.final_n > r.final_b:
                within.append(StackChange(source, "grew_within_error", key, r.final_b, r.final_n, r.peak_b,
                                          r.peak_n, se_f))
            continue
        changes.append(StackChange(source, status, key, r.final_b, r.final_n, r.peak_b, r.peak_n, se_f))
    return changes + within


MAX_WITHIN = 10         # stacks listed per source when only their sum passes the gate


def compare(baseline: str | Path, new: str | Path, budget: Budget | None = None,
            gated: tuple[str, ...] = METRICS) -> DiffReport:
    b, n = load_side(baseline), load_side(new)
    comms = sorted(set(b.procs.index) | set(n.procs.index)
                   | {c for c, _ in b.totals.index} | {c for c, _ in n.totals.index})
    processes = []
    for comm in comms:
        in_b = comm in b.procs.index or comm in b.totals.index.get_level_values(0)
        in_n = comm in n.procs.index or comm in n.totals.index.get_level_values(0)
        pd_ = ProcessDiff(comm, "both" if in_b and in_n else "new" if in_n else "gone")
        for name in ("peak_rss", "peak_arena_resident", "gpu_reserved"):
            pd_.metrics.append(Metric(name, None, _process_metric(b, comm, name), _process_metric(n, comm, name)))
        for source in SOURCES:
            idx = (comm, source)
            if idx not in b.totals.index and idx not in n.totals.index:
                continue
            for name, col in (("peak_outstanding", "peak"), ("final_outstanding", "final")):
                vb, vn = _get(b.totals, idx, col), _get(n.totals, idx, col)
                se = math.sqrt((_get(b.totals, idx, col + "_var") or 0) + (_get(n.totals, idx, col + "_var") or 0))
                pd_.metrics.append(Metric(name, source, vb, vn, se))
            pd_.stacks += _stack_changes(source, _rows(b.stacks, comm, source), _rows(n.stacks, comm, source))
        if budget is not None:
            for m in pd_.metrics:
                if m.name in gated and m.change is not None:
                    excess = m.new - budget.allowed(m.baseline)
                    m.over_budget = excess > 0 and excess > Z * m.stderr
        pd_.stacks, pd_.within_error_of = _shown(pd_)
        processes.append(pd_)
    return DiffReport(str(baseline), str(new), budget, tuple(gated), processes)


def _shown(p: ProcessDiff) -> tuple[list[StackChange], int]:
    """The stack changes beyond Z, largest first. A source whose outstanding bytes are over budget
    while none of its stacks grew beyond Z alone (the growth spread over many stacks, each within
    its error) keeps its MAX_WITHIN largest growths, marked as within error, so that the gate's
    failure names where to look; otherwise those are left out (they are noise). Returns them and
    how many grew within their error in the sources listed so."""
    over = {m.source for m in p.metrics if m.over_budget and m.name in ("peak_outstanding", "final_outstanding")}
    named = {c.source for c in p.stacks if c.status in ("grew", "new")}
    shown = [c for c in p.stacks if c.status != "grew_within_error"]
    of = 0
    for source in sorted(over - named):
        within = [c for c in p.stacks if c.status == "grew_within_error" and c.source == source]
        shown += sorted(within, key=lambda c: -c.change)[:MAX_WITHIN]
        of += len(within)
    return sorted(shown, key=lambda c: -max(abs(c.change), abs(c.new_peak - c.baseline_peak))), of


def _rows(stacks: pd.DataFrame, comm: str, source: str) -> pd.DataFrame:
    try:
        return stacks.xs((comm, source), level=("comm", "source"))
    except KeyError:
        return pd.DataFrame(columns=stacks.columns, index=pd.Index([], name="key"), dtype=float)


# --- text ----------------------------------------------------------------------------------------

def _value(m: Metric, v: float | None) -> str:
    return "n/a" if v is None else fmt_bytes(v)


def render(report: DiffReport, n: int = 10, width: int = 160) -> str:
    lines = [f"baseline {report.baseline}  ->  new {report.new}"
             + (f"  (budget {report.budget})" if report.budget else "")]
    for p in report.processes:
        head = {"both": "", "new": "  [only in new]", "gone": "  [only in baseline]"}[p.presence]
        lines.append(f"\n{printable(p.comm)}{head}{'  OVER BUDGET' if p.over_budget else ''}")
        lines.append(f"  {'metric':<34}{'baseline':>12}{'new':>12}  {'change':>30}")
        for m in p.metrics:
            label = _LABELS[m.name] + (f" ({m.source})" if m.source else "")
            change = ""
            if m.change is not None:
                change = f"{'+' if m.change >= 0 else ''}{fmt_bytes(m.change)}"
                if m.stderr:
                    change += f" ± {fmt_bytes(m.stderr)}"
                if m.baseline:
                    change += f" ({100 * m.change / m.baseline:+.0f}%)"
            flag = "  over budget" if m.over_budget else ""
            lines.append(f"  {label:<34}{_value(m, m.baseline):>12}{_value(m, m.new):>12}  {change:>30}{flag}")
        for status in ("grew", "new", "shrank", "gone", "grew_within_error"):
            shown = [s for s in p.stacks if s.status == status]
            if not shown:
                continue
            if status == "grew_within_error":
                lines.append(f"  no stack grew by more than {Z:g} standard errors alone; the largest growths"
                             f" ({len(shown)} of {p.within_error_of}), final outstanding baseline -> new, "
                             "change ± its error:")
            else:
                lines.append(f"  {status} stacks ({len(shown)}), final outstanding baseline -> new:")
            for s in shown[:n]:
                within = f" {'+' if s.change >= 0 else ''}{fmt_bytes(s.change)} ± {fmt_bytes(s.stderr)}" \
                    if status == "grew_within_error" else ""
                text = (f"    {s.source:<6} {fmt_bytes(s.baseline_final):>10} -> {fmt_bytes(s.new_final):>10}{within}"
                        f" (peak {fmt_bytes(s.baseline_peak)} -> {fmt_bytes(s.new_peak)})  {printable(s.stack)}")
                lines.append(text if len(text) <= width else text[: width - 3] + "...")
            if len(shown) > n:
                lines.append(f"    ... {len(shown) - n} more (--json lists all)")
    if report.budget is not None:
        over = [f"{printable(p.comm)}: {_LABELS[m.name]}" + (f" ({m.source})" if m.source else "")
                for p in report.processes for m in p.metrics if m.over_budget]
        lines.append("\n" + (f"OVER BUDGET ({report.budget}): " + "; ".join(over) if over
                             else f"within budget ({report.budget})"))
    return "\n".join(lines)
