"""Python frames of real interpreters: sampler.python.runtime (layout, threads, walk) and sampler.python.codeobj.

Every installed CPython 3.10-3.13 runs tests/workloads/py_nested.py, whose two threads print their
own stack (traceback.extract_stack) and block in os.read; the frames read from outside must be
exactly those.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from conftest import WORKLOADS, end_child

from sampler.python.codeobj import CodeReader, decode_linetable_310, decode_linetable_311
from sampler.python.runtime import NO_FIELD, PyUnsupported, detect

WORKLOAD = WORKLOADS / "py_nested.py"
DEBIAN_PYTHON = "/usr/bin/python3.11"
PYENV = Path("/root/.pyenv/versions")
INTERPRETERS = [DEBIAN_PYTHON, *(str(PYENV / v / "bin/python3") for v in ("3.10.13", "3.11.7", "3.12.1", "3.13.0"))]
INTERPRETERS = [p for p in INTERPRETERS if os.path.exists(p)]
OLD_INTERPRETERS = [
    str(p) for p in sorted(PYENV.glob("[23].[0-9]*/bin/python"))
    if tuple(int(x) for x in p.parent.parent.name.split(".")[:2]) < (3, 10)
]


class Nested:
    """py_nested.py running under one interpreter, both threads blocked in read()."""

    def __init__(self, cmd: list[str], script: Path):
        self.proc = subprocess.Popen([*cmd, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        reports = [json.loads(line) for line in _read_lines(self.proc, 2, timeout=30)]
        self.reports = sorted(reports, key=lambda r: "outer" not in r["qualnames"])  # main thread first
        self.pid = self.proc.pid
        if cmd[0] == "unshare":  # the interpreter is unshare's child, in a new pid namespace
            self.pid = int(Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()[0])
        self.version = tuple(self.reports[0]["version"])
        for tid in self.host_tids():
            _wait_in_read(self.pid, tid)

    def host_tids(self) -> list[int]:
        """The reports' thread ids (namespace ids) as this machine numbers them."""
        ns_to_host = {}
        for t in os.listdir(f"/proc/{self.pid}/task"):
            nspid = Path(f"/proc/{self.pid}/task/{t}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
            ns_to_host[int(nspid[-1])] = int(nspid[0])
        return [ns_to_host[r["tid"]] for r in self.reports]

    def expected(self, report: dict) -> list[tuple[str, str, int]]:
        """(function, file, line) innermost first; function is the qualname on 3.11+."""
        names = report["qualnames"] if self.version >= (3, 11) else [s[0] for s in report["stack"]]
        assert len(names) == len(report["stack"])
        return [(name, file, line) for name, (_, file, line) in zip(names, report["stack"], strict=True)][::-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(b"x")
            self.proc.stdin.close()
            end_child(self.proc)


def _read_lines(proc: subprocess.Popen, n: int, timeout: float) -> list[bytes]:
    fd, buf, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while buf.count(b"\n") < n:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"workload gave {buf!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"workload closed its stdout after {buf!r}"
            buf += chunk
    return buf.splitlines()[:n]


def _wait_in_read(pid: int, tid: int) -> None:
    """Until the thread sleeps in read(2) (x86-64 syscall 0): its frames are then fixed."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()[0] != "0":
        assert time.monotonic() < deadline, f"thread {tid} never blocked in read"
        time.sleep(0.01)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    # A non-ASCII directory makes co_filename a 4-byte-kind str (the names cover kinds 1 and 2).
    d = tmp_path / "wörk_😀"
    d.mkdir()
    return Path(shutil.copy(WORKLOAD, d / WORKLOAD.name))


@pytest.fixture(params=INTERPRETERS)
def nested(request, script: Path):
    w = Nested([request.param], script)
    yield w
    w.close()


def test_debian_python_is_among_the_interpreters():
    assert DEBIAN_PYTHON in INTERPRETERS


def check_frames(w: Nested) -> None:
    proc = detect(w.pid)
    assert proc is not None
    assert proc.version == w.version
    threads = proc.threads()
    reader = CodeReader(proc)
    main_tid, worker_tid = w.host_tids()
    assert main_tid == w.pid and {main_tid, worker_tid} <= threads.keys()
    for report, tid in zip(w.reports, (main_tid, worker_tid), strict=True):
        raw = proc.walk(tid)
        frames = reader.frames(raw)
        assert [(f.function, f.file, f.line) for f in frames] == w.expected(report)
        assert reader.frames(raw) == frames  # served from the cache, re-validated
        assert frames[-1].entry, "the outermost frame ends an eval call"
    # Main thread: every Python-to-Python call inlines on 3.11+, so only <module> is an entry;
    # 3.10 recurses in C for each call.
    main = reader.frames(proc.walk(main_tid))
    want = [True] * len(main) if w.version < (3, 11) else [False] * (len(main) - 1) + [True]
    assert [f.entry for f in main] == want
    assert any("." in f.function for f in main) == (w.version >= (3, 11))  # Holder.method
    # Worker: 深い is called from C (map) so it is an entry, its caller größe only on 3.10.
    worker = reader.frames(proc.walk(worker_tid))
    assert worker[0].entry and worker[1].entry == (w.version < (3, 11))
    proc.close()


def test_detect_threads_walk_frames(nested: Nested):
    check_frames(nested)
    proc = detect(nested.pid)
    lay = proc.layout
    assert lay.version == (nested.version[0] << 8 | nested.version[1])
    assert struct.unpack("<IHHHHHH", lay.to_bytes()) == (
        lay.version, lay.tstate_frame, lay.cframe_frame, lay.frame_code, lay.frame_back, lay.frame_instr,
        lay.frame_entry)
    assert (lay.cframe_frame != NO_FIELD) == (nested.version in ((3, 11), (3, 12)))
    assert (lay.frame_entry == NO_FIELD) == (nested.version == (3, 10))
    assert proc.eval_ranges and proc.module_ranges
    for lo, hi in proc.eval_ranges:
        assert any(mlo <= lo < hi <= mhi for mlo, mhi in proc.module_ranges)
    # sorted: the stack merge bisects them (pyenv's builds put .cold below the function, and an
    # unsorted list left every Python frame outside the interpreter frames that ran it)
    assert proc.eval_ranges == sorted(proc.eval_ranges)
    # Addresses that are not code objects never produce frames.
    reader = CodeReader(proc)
    assert reader.frames([(0, 0), (proc.runtime, 0), (proc.types.code, 0)]) == []
    proc.close()


@pytest.mark.parametrize("interpreter", [p for p in (DEBIAN_PYTHON, str(PYENV / "3.10.13/bin/python3"))
                                         if os.path.exists(p)])
def test_pid_namespace(interpreter: str, script: Path):
    """A process in its own pid namespace: tstates hold namespace tids, threads() gives ours."""
    w = Nested(["unshare", "--pid", "--fork", "--mount-proc", interpreter], script)
    try:
        assert w.reports[0]["tid"] == 1 and w.pid != 1
        check_frames(w)
    finally:
        w.close()


_SUBINTERPRETER = r"""
import os, sys, threading
try:
    import _xxsubinterpreters as interpreters
except ImportError:
    import _interpreters as interpreters
r, w = os.pipe()
sub = interpreters.create()
def runner():
    interpreters.run_string(sub, f"import os\nos.read({r}, 1)\n")
t = threading.Thread(target=runner)
t.start()
print(t.native_id, flush=True)
os.read(0, 1)
os.write(w, b"x")
t.join()
"""


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_subinterpreter(interpreter: str):
    """Two interpreters: both are listed, and each thread keeps its own (main interpreter) frames."""
    p = subprocess.Popen([interpreter, "-c", _SUBINTERPRETER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        runner_tid = int(_read_lines(p, 1, timeout=30)[0])
        _wait_in_read(p.pid, p.pid)
        _wait_in_read(p.pid, runner_tid)
        proc = detect(p.pid)
        assert len(proc.interpreters()) == 2
        reader = CodeReader(proc)
        main = reader.frames(proc.walk(p.pid))
        assert [(f.function, f.file) for f in main] == [("<module>", "<string>")]
        runner = reader.frames(proc.walk(runner_tid))
        assert runner[0].function == "runner" and runner[-1].entry
        proc.close()
    finally:
        p.stdin.close()
        p.kill()
        p.wait()


def test_not_python():
    p = subprocess.Popen(["/bin/sleep", "30"])
    try:
        assert detect(p.pid) is None
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("interpreter", OLD_INTERPRETERS)
def test_older_cpython_is_unsupported(interpreter: str):
    p = subprocess.Popen([interpreter, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        with pytest.raises(PyUnsupported, match="not supported"):
            while detect(p.pid) is None:  # None until the dynamic loader has mapped libpython
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        p.kill()
        p.wait()


_DUMP_LINES = r"""
import importlib, json, sys, types
def walk(co):
    yield co
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            yield from walk(c)
out = []
for name in ("json.decoder", "traceback", "threading", "argparse", "dataclasses", "typing", "enum"):
    path = importlib.import_module(name).__file__
    with open(path) as f:
        src = f.read()
    for co in walk(compile(src, path, "exec")):
        lines = [None] * (len(co.co_code) // 2)
        for start, end, line in co.co_lines():
            lines[start // 2 : end // 2] = [line] * (end // 2 - start // 2)
        out.append([co.co_linetable.hex(), co.co_firstlineno, lines])
print(json.dumps([list(sys.version_info[:2]), out]))
"""


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_linetable_decoders_match_co_lines(interpreter: str):
    """The decoders agree with the interpreter's own co_lines() on every instruction of big modules."""
    version, codes = json.loads(subprocess.run([interpreter, "-c", _DUMP_LINES], check=True, capture_output=True,
                                               text=True).stdout)
    decode = decode_linetable_310 if tuple(version) < (3, 11) else decode_linetable_311
    assert len(codes) > 500
    for table, firstlineno, lines in codes:
        t = decode(bytes.fromhex(table), firstlineno)
        assert [t.line(i) for i in range(len(lines))] == lines
