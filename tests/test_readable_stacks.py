"""Readable stacks on real recordings: native code without frame pointers unwound with CFI, and
Python frames read by BPF merged in place of the interpreter's eval frames.

Ground truth comes from the workloads themselves: their function names and the `# L:` markers in
their source give the lines the Python frames must carry.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import WORKLOADS, allocsampler_cmd

from analysis.dataset import latest_outstanding, read_table

pytestmark = pytest.mark.bpf
MiB = 1 << 20
PY_LEAK = WORKLOADS / "py_leak.py"


def marker_line(path: Path, marker: str) -> int:
    lines = path.read_text().splitlines()
    (n,) = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# L:{marker}")]
    return n


def interpreters() -> list[str]:
    """Every CPython 3.10+ on the machine: Debian's, and pyenv's builds (shared libpython)."""
    found = ["/usr/bin/python3.11"]
    found += sorted(glob.glob("/root/.pyenv/versions/3.1[0-9].*/bin/python3"))
    return [p for p in found if os.access(p, os.X_OK)]


@pytest.fixture(scope="module")
def leakext(tmp_path_factory) -> Path:
    """The C extension, built like most wheels: -O2, no frame pointers, no debug info."""
    d = tmp_path_factory.mktemp("leakext")
    inc = sysconfig.get_paths()["include"]
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", f"-I{inc}",
                    "-o", str(d / "leakext.so"), str(WORKLOADS / "leakext.c")], check=True)
    return d


def heaviest_stack(out: Path, pid: int) -> tuple[pd.DataFrame, pd.Series]:
    """Frames (by depth) and the stacks row of the stack holding most of the final estimate."""
    df = latest_outstanding(out, [pid])
    df = df[df["source"] == "malloc"].sort_values("outstanding_bytes", ascending=False)
    sid = df.iloc[0]["stack_id"]
    frames = read_table(out, "frames")
    stacks = read_table(out, "stacks")
    return (frames[frames["stack_id"] == sid].sort_values("depth").reset_index(drop=True),
            stacks[stacks["stack_id"] == sid].iloc[0])


def assert_in_order(frames: pd.DataFrame, expected: list[tuple[str, str | None, int | None]]) -> None:
    """`expected` (function prefix, kind, line) appear in this order, innermost first."""
    rows = list(frames.itertuples())
    i = 0
    for fn, kind, line in expected:
        while i < len(rows) and not (
                str(rows[i].function or "").startswith(fn) and (kind is None or rows[i].kind == kind)
                and (line is None or rows[i].line == line)):
            i += 1
        assert i < len(rows), f"{fn} (kind {kind}, line {line}) missing or out of order in:\n" \
                              f"{frames[['depth', 'function', 'module', 'line', 'kind']].to_string()}"
        i += 1


def python_chain(mode: str) -> list[tuple[str, str, int]]:
    """py_leak.py's Python frames for a mode, innermost first."""
    return [("do_leak", "python", marker_line(PY_LEAK, mode.removesuffix("_nogil"))),
            ("middle", "python", marker_line(PY_LEAK, "middle")),
            ("outer", "python", marker_line(PY_LEAK, "outer")),
            ("<module>", "python", marker_line(PY_LEAK, "module"))]


def record_gated(gated, record, argv, *, env=None, settle: float = 1.5, extra=()):
    t = gated(argv, ready="ready", stream="stdout", env=env)
    rec = record("--pid", str(t.pid), "-i", "1", *extra)
    rec.wait_attached()
    time.sleep(settle)          # Python detection and the thread walk happen at attach
    t.go()
    assert t.line() == "done"
    time.sleep(1.2)
    code, _, err = rec.stop()
    assert code == 0, err
    return t, rec


def completeness(out: Path) -> float:
    r = read_table(out, "recorder")
    return r["stacks_complete"].sum() / max(1, r["stacks_unwound"].sum())


@pytest.mark.parametrize("mode", ["ext", "ext_nogil"])
def test_c_extension_stack_from_python_line_to_c_function(gated, record, leakext, mode):
    """-O2 -fomit-frame-pointer extension called through three Python functions, with and without
    the GIL held: C allocator function, its C caller, then the Python chain with its lines."""
    t, rec = record_gated(gated, record, [sys.executable, str(PY_LEAK), mode, str(256 << 10), "400"],
                          env={"PYTHONPATH": str(leakext)})
    frames, stack = heaviest_stack(rec.out, t.pid)
    assert_in_order(frames, [("ext_alloc_record", "native", None), ("ext_parse_record", "native", None),
                             *python_chain(mode)])
    assert frames.iloc[0]["function"].startswith("ext_alloc_record")     # the caller of malloc
    assert stack["unwind_stop"] == "entry" and not stack["truncated"]
    # the interpreter's eval frames are replaced, not shown beside the Python frames
    assert not frames["function"].fillna("").str.contains("_PyEval_EvalFrameDefault").any()
    assert completeness(rec.out) >= 0.95


def test_torch_cpu_op_gets_python_frames(gated, record):
    """torch releases the GIL in its ops; the tensor allocation (c10's CPU allocator) still
    carries the Python chain above libtorch's frames."""
    t, rec = record_gated(gated, record, [sys.executable, str(PY_LEAK), "torch", str(1 << 20), "96"],
                          settle=2.0)
    frames, stack = heaviest_stack(rec.out, t.pid)
    native = frames[frames["kind"] == "native"]
    assert native.iloc[0]["module"].startswith("libc10"), frames.to_string()
    assert_in_order(frames, python_chain("torch"))
    assert stack["unwind_stop"] == "entry"
    assert completeness(rec.out) >= 0.95


def test_training_loop_leak_finding_names_the_train_step(gated, record):
    """The seed's `loss_history.append(loss)` bug: the persistent-growth finding's stack names
    the training step's Python function and line."""
    script = WORKLOADS / "torch_train_leak.py"
    t, rec = record_gated(gated, record, [sys.executable, str(script), "22"], settle=2.0)
    p = subprocess.run(allocsampler_cmd("analyze", str(rec.out), "--json", "--source", "malloc"),
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    growth = [f for f in json.loads(p.stdout)["findings"] if f["kind"] == "persistent_growth"]
    assert growth, p.stdout
    top = max(growth, key=lambda f: f["outstanding_bytes"])
    py = [(f["function"], f["line"]) for f in top["frames"] if f["kind"] == "python"]
    assert ("train_step", marker_line(script, "forward")) in py, top["frames"]
    assert ("train", marker_line(script, "step")) in py, top["frames"]
    assert "train_step" in top["summary"], top["summary"]


@pytest.mark.parametrize("python", interpreters(), ids=lambda p: p.split("/")[-3] if "pyenv" in p else "debian")
def test_python_frames_on_every_interpreter(gated, record, python):
    """Each CPython on the machine: the BPF walk with that version's layout gives the right
    functions and lines."""
    t, rec = record_gated(gated, record, [python, str(PY_LEAK), "bytes", str(256 << 10), "300"])
    frames, stack = heaviest_stack(rec.out, t.pid)
    assert_in_order(frames, python_chain("bytes"))
    assert (frames["kind"] == "python").sum() == 4, frames.to_string()
    assert stack["unwind_stop"] == "entry"


def test_no_python_flag_keeps_native_frames_only(gated, record, leakext):
    t, rec = record_gated(gated, record, [sys.executable, str(PY_LEAK), "ext", str(256 << 10), "200"],
                          env={"PYTHONPATH": str(leakext)}, extra=("--no-python",))
    frames, _ = heaviest_stack(rec.out, t.pid)
    assert (frames["kind"] == "native").all()
    assert_in_order(frames, [("ext_alloc_record", "native", None), ("ext_parse_record", "native", None),
                             ("_PyEval_EvalFrameDefault", "native", None)])
