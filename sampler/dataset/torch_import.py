"""Import a PyTorch CUDA memory snapshot into an allocsampler dataset.

    torch.cuda.memory._record_memory_history()
    ...
    with open("snap.pickle", "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)

    allocsampler import-torch snap.pickle --out DIR [--pid PID]

The snapshot's segments (what the caching allocator reserved: cudaMalloc, or cuMemCreate for
expandable segments) become source `cuda` (`cuda-driver` when expandable) and its live blocks
(tensors) source `torch`, per stack, in the same `outstanding`, `stacks`, `frames` and
`processes` tables a recording writes (exact: stderr 0), so that `analyze`, `report`, `top`
and `diff` read it like a recording. With a trace (`device_traces`, entries carrying `time_us`),
the state is replayed into a time series: the state before the trace is the final one with the
trace undone; without one, the dataset has one snapshot.

The pickle is read with an unpickler that builds only plain containers and numbers: a snapshot
is dicts, lists, strings and numbers, and nothing else is loaded from the file.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import os
import pickle
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from sampler import __version__
from sampler.dataset.schema import (
    CUDA,
    CUDA_DRIVER,
    FRAMES,
    OUTSTANDING,
    PROCESSES,
    RECORDINGS,
    SCHEMA_VERSION,
    STACKS,
    TARGETS,
    TORCH,
)
from sampler.dataset.writer import DatasetWriter
from sampler.errors import UsageError

SEGMENT_ADD = ("segment_alloc", "segment_map")
SEGMENT_REMOVE = ("segment_free", "segment_unmap")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise UsageError(f"not a PyTorch memory snapshot: the pickle refers to {module}.{name} "
                         "(a snapshot holds only dicts, lists, strings and numbers)")


def load(path: str | os.PathLike) -> dict:
    """The snapshot as plain Python data; UsageError when it is not one."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        snap = _PlainUnpickler(io.BytesIO(data)).load()
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"{path} is not a pickle ({e}); write it with pickle.dump(torch.cuda.memory._snapshot(), f)") \
            from None
    if isinstance(snap, list):                 # very old format: segments only
        snap = {"segments": snap, "device_traces": []}
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise UsageError(f"{path}: no 'segments' list: not a torch.cuda.memory._snapshot()")
    return snap


# --- stacks ------------------------------------------------------------------------------------

def _frame(f: dict) -> dict:
    name, file, line = str(f.get("name") or "") or None, str(f.get("filename") or ""), f.get("line")
    line = int(line) if isinstance(line, int) and line > 0 else None
    python = file.endswith(".py")
    known = file and not file.startswith("??")
    return {"function": name, "module": os.path.basename(file) if known else "[unknown]",
            "path": file if known else None, "file": file if known else None, "line": line,
            "kind": "python" if python else "native"}


def _stack_id(frames: tuple[dict, ...]) -> int:
    content = tuple((f["kind"], f["path"], f["function"], f["line"]) for f in frames)
    h = hashlib.blake2b(repr(("torch-snapshot", content)).encode(), digest_size=8).digest()
    return struct.unpack("<q", h)[0]


def _block_frames(b: dict) -> list:
    if "frames" in b:
        return b["frames"] or []
    hist = b.get("history") or []                     # before torch 2.1
    return (hist[0].get("frames") or []) if hist else []


class _Stacks:
    def __init__(self):
        self.by_key: dict[tuple, int] = {}
        self.frames: dict[int, tuple[dict, ...]] = {}

    def intern(self, raw: list) -> int:
        key = tuple((str(f.get("filename")), str(f.get("name")), f.get("line")) for f in raw if isinstance(f, dict))
        sid = self.by_key.get(key)
        if sid is None:
            frames = tuple(_frame(f) for f in raw if isinstance(f, dict))
            sid = self.by_key[key] = _stack_id(frames)
            self.frames[sid] = frames
        return sid


# --- state -------------------------------------------------------------------------------------

@dataclass
class _Item:
    size: int
    stack_id: int
    source: str


class _State:
    """Live blocks (source torch) and segments (cuda / cuda-driver) by (device, address)."""

    def __init__(self):
        self.blocks: dict[tuple, _Item] = {}
        self.segments: dict[tuple, _Item] = {}      # expandable: one entry per mapped range

    def totals(self) -> dict[tuple[str, int], tuple[float, int]]:
        out: dict[tuple[str, int], list] = {}
        for it in (*self.blocks.values(), *self.segments.values()):
            acc = out.setdefault((it.source, it.stack_id), [0.0, 0])
            acc[0] += it.size
            acc[1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}

    def reserved(self) -> float:
        return float(sum(it.size for it in self.segments.values()))

    def allocated(self) -> float:
        return float(sum(it.size for it in self.blocks.values()))


def _final_state(snap: dict, stacks: _Stacks) -> _State:
    st = _State()
    for seg in snap["segments"]:
        dev = int(seg.get("device", 0))
        base = int(seg.get("address") or 0)
        expandable = bool(seg.get("is_expandable"))
        seg_sid = stacks.intern(seg.get("frames") or [])
        st.segments[(dev, base)] = _Item(int(seg.get("total_size", 0)), seg_sid,
                                         CUDA_DRIVER if expandable else CUDA)
        addr = base
        for b in seg.get("blocks", []):
            size = int(b.get("size", 0))
            a = int(b.get("address", addr))
            if b.get("state") == "active_allocated":
                st.blocks[(dev, a)] = _Item(size, stacks.intern(_block_frames(b)), TORCH)
            addr = a + size
    return st


def _events(snap: dict) -> list[tuple[int, int, dict]]:
    """(time_us, device, entry) of every trace entry, in order (index order where time ties)."""
    out = []
    for dev, trace in enumerate(snap.get("device_traces") or []):
        for i, e in enumerate(trace or []):
            if isinstance(e, dict) and "action" in e:
                out.append((int(e.get("time_us") or 0), dev, i, e))
    out.sort(key=lambda x: (x[0], x[1], x[2]))
    return [(t, d, e) for t, d, _, e in out]


def _segment_of(st: _State, dev: int, addr: int) -> tuple | None:
    for (d, base), it in st.segments.items():
        if d == dev and base <= addr < base + max(it.size, 1):
            return (d, base)
    return None


def _apply(st: _State, stacks: _Stacks, dev: int, e: dict, undo: bool, frees: str) -> None:
    """One trace entry forward, or undone (`undo`) when walking back from the final state."""
    action, addr, size = e["action"], int(e.get("addr", 0)), int(e.get("size", 0))
    key = (dev, addr)
    add = action == "alloc" or action in SEGMENT_ADD
    remove = action == frees or action in SEGMENT_REMOVE
    if not (add or remove):
        return
    if undo:
        add, remove = remove, add
    table = st.blocks if action in ("alloc", frees) else st.segments
    if table is st.blocks:
        if add:
            table[key] = _Item(size, stacks.intern(e.get("frames") or []), TORCH)
        else:
            table.pop(key, None)
        return
    # segments: an expandable segment maps and unmaps ranges inside its reservation
    expandable = action in ("segment_map", "segment_unmap")
    source = CUDA_DRIVER if expandable else CUDA
    if add:
        if key not in table and _segment_of(st, dev, addr) is None:
            table[key] = _Item(size, stacks.intern(e.get("frames") or []), source)
        elif key not in table:
            table[_segment_of(st, dev, addr)].size += size
        else:
            table[key].size += size if expandable else 0
    else:
        seg = key if key in table else _segment_of(st, dev, addr)
        if seg is None:
            return
        if expandable and table[seg].size > size:
            table[seg].size -= size
        else:
            del table[seg]


@dataclass
class ImportSummary:
    recording_id: str
    points: int
    stacks: int
    reserved_bytes: float
    allocated_bytes: float


def import_snapshot(path: str | os.PathLike, out: str | os.PathLike, *, pid: int = 0, comm: str = "torch",
                    points: int = 100, at: dt.datetime | None = None) -> ImportSummary:
    """Write the snapshot at `path` into the dataset `out` (a new recording in it)."""
    snap = load(path)
    stacks = _Stacks()
    final = _final_state(snap, stacks)
    events = _events(snap)
    frees = "free_requested" if any(e["action"] == "free_requested" for _, _, e in events) else "free_completed"
    at = at or dt.datetime.fromtimestamp(os.stat(path).st_mtime, dt.timezone.utc)
    timed = [t for t, _, _ in events if t > 0]
    # epoch microseconds when they look like it (after 2001), else relative: ending at `at`
    if timed and timed[-1] > 10 ** 15:
        to_wall = lambda us: dt.datetime.fromtimestamp(us / 1e6, dt.timezone.utc)      # noqa: E731
    else:
        end = timed[-1] if timed else 0
        to_wall = lambda us: at - dt.timedelta(microseconds=end - us)                  # noqa: E731
    states: list[tuple[dt.datetime, dict, float, float]] = []
    if len(timed) >= 2 and timed[-1] > timed[0]:
        st = _State()
        st.blocks = {k: _Item(v.size, v.stack_id, v.source) for k, v in final.blocks.items()}
        st.segments = {k: _Item(v.size, v.stack_id, v.source) for k, v in final.segments.items()}
        for _, dev, e in reversed(events):
            _apply(st, stacks, dev, e, True, frees)
        t0, t1 = timed[0], timed[-1]
        n = max(2, min(points, len(events)))
        grid = [t0 + (t1 - t0) * i // (n - 1) for i in range(n)]
        gi = 0
        for t, dev, e in events:
            while gi < len(grid) - 1 and t > grid[gi]:
                states.append((to_wall(grid[gi]), st.totals(), st.reserved(), st.allocated()))
                gi += 1
            _apply(st, stacks, dev, e, False, frees)
    # the final state is the snapshot's own (exact), after the trace
    last_ts = to_wall(timed[-1]) if timed else at
    if states and states[-1][0] >= last_ts:
        states = states[:-1]
    states.append((last_ts, final.totals(), final.reserved(), final.allocated()))

    host = socket.gethostname()
    rec_id = f"torch-{Path(path).stem}-{last_ts:%Y%m%dT%H%M%SZ}"
    w = DatasetWriter(out, rec_id, host=host)
    day = last_ts.date()
    base = {"recording_id": rec_id, "host": host}
    out_rows, proc_rows = [], []
    prev: dict[tuple[str, int], tuple[float, int]] = {}
    prev_ts = None
    for ts, totals, reserved, allocated in states:
        interval = (ts - prev_ts).total_seconds() if prev_ts else 0.0
        for key in set(totals) | set(prev):
            b, n = totals.get(key, (0.0, 0))
            pb, pn = prev.get(key, (0.0, 0))
            if n == 0 and pn == 0:
                continue
            grown, shrunk = max(0.0, b - pb), max(0.0, pb - b)
            out_rows.append({**base, "ts": ts, "interval_s": interval, "pid": pid, "comm": comm, "source": key[0],
                             "stack_id": key[1], "outstanding_bytes": b, "outstanding_stderr_bytes": 0.0,
                             "outstanding_objects": float(n), "outstanding_stderr_objects": 0.0, "live_samples": n,
                             "allocated_bytes": grown, "allocated_stderr_bytes": 0.0,
                             "allocated_objects": float(max(0, n - pn)), "freed_bytes": shrunk,
                             "freed_objects": float(max(0, pn - n)), "alloc_samples": max(0, n - pn),
                             "free_samples": max(0, pn - n), "oldest_age_s": None})
        proc_rows.append({**base, "ts": ts, "pid": pid, "comm": comm, "gpu_reserved_bytes": reserved,
                          "gpu_allocated_bytes": allocated, "gpu_allocated_stderr_bytes": 0.0})
        prev, prev_ts = totals, ts
    first_ts = states[0][0]
    stack_rows, frame_rows = [], []
    for sid, frames in stacks.frames.items():
        labels = [_label(f) for f in frames]
        stack_rows.append({**base, "ts": first_ts, "stack_id": sid, "n_frames": len(frames), "truncated": False,
                           "site": labels[0] if labels else None, "summary": " < ".join(labels) or "[no stack]",
                           "unwind_stop": "entry", "python_frames": sum(f["kind"] == "python" for f in frames)})
        frame_rows += [{**base, "ts": first_ts, "stack_id": sid, "depth": i, **f, "offset": None, "build_id": None,
                        "inlined": False} for i, f in enumerate(frames)]
    w.write(OUTSTANDING, out_rows, day=day)
    w.write(PROCESSES, proc_rows, day=day)
    w.write(STACKS, stack_rows, day=day)
    w.write(FRAMES, frame_rows, day=day)
    w.write(TARGETS, [{**base, "ts": first_ts, "pid": pid, "event": "attach", "comm": comm, "exe": None,
                       "cmdline": None, "ppid": None, "allocators": ["pytorch:snapshot"], "probes": [],
                       "detail": f"imported PyTorch memory snapshot {path}"}], day=day)
    w.write(RECORDINGS, [{"recording_id": rec_id, "host": host, "started": first_ts, "ended": last_ts,
                          "schema_version": SCHEMA_VERSION, "sampler_version": __version__, "sample_mean_bytes": 0,
                          "interval_s": (last_ts - first_ts).total_seconds() / max(1, len(states) - 1),
                          "probe_mode": "import", "kernel": None, "argv": f"import-torch {path}",
                          "gpu_status": f"imported PyTorch memory snapshot {Path(path).name}"}],
            name=rec_id, day=day)
    return ImportSummary(rec_id, len(states), len(stacks.frames), final.reserved(), final.allocated())


def _label(f: dict) -> str:
    if f["kind"] == "python":
        return f"{f['function']} ({f['module']}:{f['line']})" if f["line"] else f"{f['function']} ({f['module']})"
    return f"{f['function'] or '?'} ({f['module']})"
