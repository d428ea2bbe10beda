"""pprof export: a gzipped `perftools.profiles.Profile` that pprof, Pyroscope, Parca and speedscope read.

The protobuf is written here from the field numbers of the upstream `profile.proto`
(github.com/google/pprof, proto/profile.proto), so exporting needs no protobuf runtime.

Sample types follow Go's heap profiles: `alloc_objects`, `alloc_space` (allocated over a window)
and `inuse_objects`, `inuse_space` (outstanding at its end), and `pinned_space` (at the last
snapshot before its end that read the heap's layout: the free bytes of heap pages that a stack's
live blocks keep resident, outstanding.pinned_bytes; 0 where not measured). Values are the dataset's unbiased
estimates rounded to integers; one sample per process and stack, labelled with pid and comm.
"""

from __future__ import annotations

import datetime as dt
import gzip
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds

from analysis.dataset import read_outstanding, read_table
from analysis.frames import Stacks, read_stack_frames
from sampler import files

# (sample type, unit, outstanding column); Go's order, so tools default to the last (inuse_space)
SAMPLE_TYPES: tuple[tuple[str, str, str], ...] = (
    ("alloc_objects", "count", "allocated_objects"),
    ("alloc_space", "bytes", "allocated_bytes"),
    ("inuse_objects", "count", "outstanding_objects"),
    ("pinned_space", "bytes", "pinned_bytes"),
    ("inuse_space", "bytes", "outstanding_bytes"),
)
VALUE_NAMES = tuple(t for t, _, _ in SAMPLE_TYPES)
_U64 = (1 << 64) - 1


# --- selection ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """inuse_* at `end` (each process's last snapshot at or before it; None: its last one);
    alloc_* summed over the intervals that end in (start, end] (start None: from the beginning)."""

    start: dt.datetime | None = None
    end: dt.datetime | None = None


def _ts_filter(expr, column: str, op: str, when: dt.datetime | None):
    if when is None:
        return expr
    bound = pa.scalar(when, pa.timestamp("us", tz="UTC"))
    e = ds.field(column) <= bound if op == "<=" else ds.field(column) > bound
    return e if expr is None else expr & e


def profile_values(root: str | Path, *, window: Window | None = None, source: str = "malloc",
                   pids: list[int] | None = None) -> pd.DataFrame:
    """One row per (recording, process, stack) with the sample types as columns, plus
    recording_id, pid, comm, host, stack_id; rows that are zero in all of them are dropped.
    attrs["first_ts"], attrs["last_ts"]: the span of the rows read (None when there are none)."""
    window = window or Window()
    flt = ds.field("source") == source
    if pids:
        flt = flt & ds.field("pid").isin(pids)
    flt = _ts_filter(flt, "ts", "<=", window.end)
    cols = ["ts", "recording_id", "host", "pid", "comm", "stack_id", *(c for _, _, c in SAMPLE_TYPES)]
    out, _ = read_outstanding(root, filter=flt, columns=cols, pids=pids)   # the running state, not a teardown
    keys = ["recording_id", "pid"]
    if out.empty:
        empty = pd.DataFrame(columns=[*keys, "comm", "host", "stack_id", *VALUE_NAMES])
        empty.attrs.update(first_ts=None, last_ts=None)
        return empty
    # A snapshot in which a process held nothing has no outstanding rows: its processes row
    # (same ts) still marks it, so an emptied process is not shown with older memory.
    pflt = _ts_filter(ds.field("pid").isin(pids) if pids else None, "ts", "<=", window.end)
    snaps = pd.concat([out[["ts", *keys]], read_table(root, "processes", filter=pflt, columns=["ts", *keys])])
    last = snaps.groupby(keys, observed=True)["ts"].max().rename("last_ts")
    out = out.merge(last, left_on=keys, right_index=True, how="left")
    names = {c: t for t, _, c in SAMPLE_TYPES}
    inuse = out[out["ts"] == out["last_ts"]]
    inuse = inuse.groupby([*keys, "stack_id"], observed=True)[["outstanding_bytes", "outstanding_objects"]].sum()
    # pinned pages: at the last snapshot that charged them (heap layouts are read as their cost allows)
    pin = out[out["pinned_bytes"].notna()]
    pin = pin[pin["ts"] == pin.groupby(keys, observed=True)["ts"].transform("max")]
    inuse = inuse.join(pin.groupby([*keys, "stack_id"], observed=True)[["pinned_bytes"]].sum(), how="outer")
    alloc = out if window.start is None else out[out["ts"] > pd.Timestamp(window.start)]
    alloc = alloc.groupby([*keys, "stack_id"], observed=True)[["allocated_bytes", "allocated_objects"]].sum()
    values = inuse.join(alloc, how="outer").fillna(0.0).rename(columns=names).reset_index()
    values = values[(values[list(VALUE_NAMES)] != 0).any(axis=1)]
    # name each process as it was last seen in the window
    who = out.sort_values("ts").groupby(keys, observed=True)[["comm", "host"]].last().astype(str)
    values = values.merge(who, left_on=keys, right_index=True, how="left")[
        [*keys, "comm", "host", "stack_id", *VALUE_NAMES]]
    values.attrs.update(first_ts=out["ts"].min(), last_ts=out["ts"].max())
    return values


def sample_period(root: str | Path) -> int:
    rec = read_table(root, "recordings", columns=["sample_mean_bytes"])
    return int(rec["sample_mean_bytes"].iloc[0]) if len(rec) else 0


# --- protobuf encoding (profile.proto field numbers) ----------------------------------------------

def _varint(v: int) -> bytes:
    v &= _U64                      # int64 negatives are ten-byte two's complement on the wire
    out = bytearray()
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _num(field_no: int, v: int | bool) -> bytes:
    return b"" if not v else _varint(field_no << 3) + _varint(int(v))     # proto3: defaults omitted


def _len(field_no: int, data: bytes) -> bytes:
    return _varint(field_no << 3 | 2) + _varint(len(data)) + data


def _packed(field_no: int, values: list[int]) -> bytes:
    return _len(field_no, b"".join(_varint(v) for v in values)) if values else b""


@dataclass
class _Mapping:
    id: int
    filename: int
    build_id: int
    limit: int = 0
    functions: bool = False
    filenames: bool = False
    lines: bool = False


@dataclass
class ProfileBuilder:
    """Accumulates samples; `encode()` gives the serialized Profile (not gzipped)."""

    sample_types: tuple[tuple[str, str], ...] = tuple((t, u) for t, u, _ in SAMPLE_TYPES)
    strings: dict[str, int] = field(default_factory=lambda: {"": 0})
    functions: dict[tuple, int] = field(default_factory=dict)
    mappings: dict[tuple, _Mapping] = field(default_factory=dict)
    locations: dict[tuple, bytes] = field(default_factory=dict)     # key -> encoded Location
    location_ids: dict[tuple, int] = field(default_factory=dict)
    samples: list[bytes] = field(default_factory=list)

    def string(self, s: str) -> int:
        return self.strings.setdefault(s, len(self.strings))

    def function(self, name: str, filename: str, module: str = "") -> int:
        key = (name, filename, module)       # same name in two modules: two functions
        fid = self.functions.get(key)
        if fid is None:
            fid = self.functions[key] = len(self.functions) + 1
        return fid

    def mapping(self, filename: str, build_id: str) -> _Mapping:
        key = (filename, build_id)
        m = self.mappings.get(key)
        if m is None:
            m = self.mappings[key] = _Mapping(len(self.mappings) + 1, self.string(filename), self.string(build_id))
        return m

    def location(self, f: dict[str, Any]) -> int:
        fn, file, line = f.get("function"), f.get("file") or "", int(f.get("line") or 0)
        module = str(f.get("module") or "")
        if f.get("kind") == "python" or not (module or f.get("path")):
            key: tuple = ("src", fn, file, line)     # interpreter frames: no binary mapping, a source line
            mapping, address = None, 0
        else:
            mapping = self.mapping(str(f.get("path") or module), str(f.get("build_id") or ""))
            address = int(f.get("offset") or 0) & _U64   # ELF address: mapping starts at 0, offset 0
            key = ("native", mapping.id, address, fn, file, line)
        lid = self.location_ids.get(key)
        if lid is not None:
            return lid
        lid = self.location_ids[key] = len(self.location_ids) + 1
        body = _num(1, lid)
        if mapping is not None:
            body += _num(2, mapping.id) + _num(3, address)
            mapping.limit = max(mapping.limit, address + 1)
        if fn:
            fid = self.function(str(fn), str(file), "" if mapping is None else module)
            body += _len(4, _num(1, fid) + _num(2, line))
            if mapping is not None:
                mapping.functions = True
                mapping.filenames |= bool(file)
                mapping.lines |= bool(line)
        self.locations[key] = body
        return lid

    def add(self, frames: list[dict[str, Any]], values: list[int], labels: dict[str, str | int]) -> None:
        """One sample: frames innermost first (pprof's order), one value per sample type."""
        if not frames:     # keep the bytes: a stack that could not be captured still counts
            frames = [{"function": "[no stack]"}]
        body = _packed(1, [self.location(f) for f in frames]) + _packed(2, values)
        for k, v in labels.items():
            label = _num(1, self.string(k)) + (_num(3, v) if isinstance(v, int) else _num(2, self.string(v)))
            body += _len(3, label)
        self.samples.append(body)

    def encode(self, *, time_nanos: int = 0, duration_nanos: int = 0, period: int = 0,
               comments: tuple[str, ...] = (), default_sample_type: str = "inuse_space") -> bytes:
        fn_names = {fid: key for key, fid in self.functions.items()}
        # intern every string before the table is written
        fn_msgs = [(fid, self.string(name), self.string(filename)) for fid, (name, filename, _) in fn_names.items()]
        types = [(self.string(t), self.string(u)) for t, u in self.sample_types]
        period_type = (self.string("space"), self.string("bytes"))
        comment_ids = [self.string(c) for c in comments]
        default = self.string(default_sample_type)
        out = bytearray()
        for t, u in types:
            out += _len(1, _num(1, t) + _num(2, u))
        for s in self.samples:
            out += _len(2, s)
        for m in self.mappings.values():
            out += _len(3, _num(1, m.id) + _num(3, m.limit) + _num(5, m.filename) + _num(6, m.build_id)
                        + _num(7, m.functions) + _num(8, m.filenames) + _num(9, m.lines))
        for loc in self.locations.values():
            out += _len(4, loc)
        for fid, name, filename in fn_msgs:
            # names are already demangled: no system_name, or pprof would demangle them again and
            # read Python's `<module>` as a C++ template argument list
            out += _len(5, _num(1, fid) + _num(2, name) + _num(4, filename))
        for s in self.strings:          # dicts keep insertion order: index = position
            out += _len(6, s.encode())
        out += _num(9, time_nanos) + _num(10, duration_nanos)
        out += _len(11, _num(1, period_type[0]) + _num(2, period_type[1])) + _num(12, period)
        out += _packed(13, comment_ids) + _num(14, default)
        return bytes(out)


# --- export ------------------------------------------------------------------------------------

def _nanos(t: pd.Timestamp | dt.datetime | None) -> int:
    return int(pd.Timestamp(t).value) if t is not None and not pd.isna(t) else 0


def build_profile(values: pd.DataFrame, frames: Stacks, *, source: str,
                  window: Window | None = None, period: int = 0) -> bytes:
    """The serialized Profile of `profile_values()` rows."""
    window = window or Window()
    b = ProfileBuilder()
    for r in values.itertuples(index=False):
        labels: dict[str, str | int] = {"pid": int(r.pid), "comm": str(r.comm)}
        if isinstance(r.host, str) and r.host not in ("", "nan", "None"):
            labels["host"] = r.host
        b.add(frames.get(int(r.stack_id), []), [round(getattr(r, n)) for n in VALUE_NAMES], labels)
    end = window.end or values.attrs.get("last_ts")
    start = window.start or values.attrs.get("first_ts")
    duration = max(_nanos(end) - _nanos(start), 0) if start is not None and end is not None else 0
    comments = (f"allocsampler export: source={source}",
                "values are unbiased estimates from sampled allocations (Poisson sampling over bytes)",
                "inuse_*: outstanding at the end of the window; alloc_*: allocated in snapshot intervals "
                "that end inside the window")
    return b.encode(time_nanos=_nanos(end), duration_nanos=duration, period=period, comments=comments)


def write_pprof(root: str | Path, values: pd.DataFrame, out: str | Path, *, source: str,
                window: Window | None = None, frames: Stacks | None = None) -> None:
    """Write OUT, the gzipped Profile of `profile_values(root, ...)` rows."""
    frames = read_stack_frames(root) if frames is None else frames
    data = build_profile(values, frames, source=source, window=window, period=sample_period(root))
    files.write_output(out, gzip.compress(data, mtime=0))      # 0600, no link followed
