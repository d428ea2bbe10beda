"""Shared fixtures: compiled workloads, a target process driver, and the recorder CLI.

BPF tests never skip: if this machine cannot load BPF the session fixture fails loudly.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from servers import NOBODY, drop_to_nobody  # noqa: F401  (scripts/servers.py; re-exported to the tests)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent                      # the repository
WORKLOADS = HERE / "workloads"
PROTO = HERE / "proto"                  # upstream's profile.proto, the pprof reader's schema


def compile_c(src: Path, out: Path, *flags: str) -> Path:
    cmd = ["gcc", "-O1", "-g", "-fno-omit-frame-pointer", "-fno-builtin", *flags, "-o", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def leakext(tmp_path_factory) -> Path:
    """tests/workloads/leakext.c as a C extension built like most wheels: -O2, no frame pointers,
    no debug info. Its directory (for PYTHONPATH)."""
    d = tmp_path_factory.mktemp("leakext")
    inc = sysconfig.get_paths()["include"]
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", f"-I{inc}",
                    "-o", str(d / "leakext.so"), str(WORKLOADS / "leakext.c")], check=True)
    return d


@pytest.fixture(scope="session")
def profile_pb2(tmp_path_factory):
    """The pprof reader's classes (tests/readers.py decode)."""
    from grpc_tools import protoc
    d = tmp_path_factory.mktemp("proto")
    # the reader's schema: upstream's profile.proto (tests/proto/profile.proto), compiled by protoc
    assert protoc.main(["protoc", f"-I{PROTO}", f"--python_out={d}", str(PROTO / "profile.proto")]) == 0
    sys.path.insert(0, str(d))
    try:
        return importlib.import_module("profile_pb2")
    finally:
        sys.path.remove(str(d))


@pytest.fixture(scope="session")
def bpf_ready():
    """Fails (never skips) the BPF tests when the machine cannot record."""
    from sampler.bpf import preflight
    from sampler.errors import AllocsamplerError
    try:
        preflight.check_all()
    except AllocsamplerError as e:
        pytest.fail(f"BPF tests need a machine that can record: {e}")


@pytest.fixture(scope="session")
def leaky_lib(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("leaky")
    return compile_c(WORKLOADS / "leaky.c", d / "libleaky.so", "-shared", "-fPIC")


class Workload:
    """A Python process that loads a workload library and runs its functions on request."""

    def __init__(self, lib: Path, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKLOADS / "driver.py"), str(lib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})
        assert json.loads(self.proc.stdout.readline())["ready"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, name: str, *args: int, thread: bool = False) -> int:
        self.start_call(name, *args, thread=thread)
        return self.result()

    def start_call(self, name: str, *args: int, thread: bool = False) -> None:
        """Send a call without waiting for it (collect it with result())."""
        self.proc.stdin.write(json.dumps({"call": name, "args": list(args), "thread": thread}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> int:
        return json.loads(self.proc.stdout.readline())["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            end_child(self.proc)


@pytest.fixture
def workload(leaky_lib):
    made: list[Workload] = []

    def start(env: dict | None = None) -> Workload:
        w = Workload(leaky_lib, env)
        made.append(w)
        return w

    yield start
    for w in made:
        w.close()


class GatedTarget:
    """A compiled target that announces itself on a pipe and waits for a go line on stdin, so
    that the recorder can attach before the interesting part runs."""

    def __init__(self, argv: list[str], *, ready: str, stream: str = "stderr", env: dict | None = None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, text=True,
                                     stdout=subprocess.PIPE if stream == "stdout" else None,
                                     stderr=subprocess.PIPE if stream == "stderr" else None,
                                     env={**os.environ, **(env or {})})
        self._out = self.proc.stdout if stream == "stdout" else self.proc.stderr
        assert self.line() == ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def line(self) -> str:
        return self._out.readline().strip()

    def go(self, text: str = "go\n") -> None:
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def gated():
    made: list[GatedTarget] = []

    def start(argv: list[str], **kw) -> GatedTarget:
        made.append(GatedTarget(argv, **kw))
        return made[-1]

    yield start
    for t in made:
        t.kill()


def end_child(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Wait for a child told to end (its stdin closed); kill it if it does not."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def allocsampler_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sampler.cli", *args]


# Modules of the standard library that our child interpreters import first (ctypes: the probe-cost
# calibration; multiprocessing: the fleet's forkserver; json: most children), planted as another
# user could leave them in a directory that root runs a command from.
PLANTED = ("ctypes", "json", "multiprocessing")
_PLANTED_INIT = '''import importlib.machinery, importlib.util, os, sys
with open({marker!r}, "a") as f:
    f.write(f"{{__name__}} imported by pid {{os.getpid()}} {{sys.argv!r}}\\n")
# then the real module in its place: the command goes on, the marker alone tells
_here = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))
_spec = importlib.machinery.PathFinder.find_spec(__name__, [p for p in sys.path if os.path.realpath(p) != _here])
sys.modules[__name__] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sys.modules[__name__])
'''


def planted_dir(d: Path, marker: Path) -> Path:
    """`d`, made, holding PLANTED: each one imported notes it in `marker` (name, pid, argv)."""
    for name in PLANTED:
        (d / name).mkdir(parents=True)
        (d / name / "__init__.py").write_text(_PLANTED_INIT.format(marker=str(marker)))
    return d


class Recording:
    """`allocsampler record` running as a separate process, as users run it."""

    def __init__(self, out: Path, *args: str):
        self.out = out
        if not any(a.startswith("--cpu-budget") for a in args):
            # accuracy tests compare with ground truth with every allocation probed; the
            # governor's tests (test_tiers.py) turn it on
            args = ("--cpu-budget", "0", *args)
        self.proc = subprocess.Popen(allocsampler_cmd("record", "-o", str(out), "-q", *args),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_attached(self, timeout: float = 60, pid: int | None = None, after_exec: bool = False) -> None:
        """Until a target's (`pid`'s) `attach` row is on disk: its probes are in place (a `tier`
        row can come first, before the probes of that tier). `after_exec`: the attach row of the
        image `pid` exec'd (placed again: a `tier` row after its `exec` row)."""
        from analysis.dataset import read_table
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"recorder exited early: {self.proc.communicate()}")
            if any((self.out / "targets").glob("host=*/date=*/*.parquet")):
                t = read_table(self.out, "targets")
                if after_exec:
                    t = t[t["pid"] == pid].sort_values("ts", kind="stable")
                    events = list(t["event"])
                    if "exec" in events and "tier" in events[events.index("exec"):]:
                        return
                elif ((t["event"] == "attach") & (pid is None or t["pid"] == pid)).any():
                    return
            time.sleep(0.1)
        raise AssertionError("recorder did not attach in time")

    def wait_snapshots(self, n: int, timeout: float = 60) -> None:
        """Until the recording has written `n` interval snapshots (its `recorder` rows' files)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(list((self.out / "recorder").glob("host=*/date=*/*.parquet"))) >= n:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"recorder exited early: {self.proc.communicate()}")
            time.sleep(0.05)
        raise AssertionError(f"fewer than {n} snapshots in {timeout} s")

    def wait_snapshot(self, after: float, timeout: float = 30) -> None:
        """Wait for an outstanding snapshot file written after the time `after`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.stat().st_mtime > after for p in (self.out / "recorder").glob("host=*/date=*/*.parquet")):
                return
            time.sleep(0.1)
        raise AssertionError("no snapshot written in time")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> tuple[int, str, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


@pytest.fixture
def record(tmp_path, bpf_ready):
    made: list[Recording] = []

    def start(*args: str, out: Path | None = None) -> Recording:
        r = Recording(out or tmp_path / f"rec{len(made)}", *args)
        made.append(r)
        return r

    yield start
    for r in made:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


def final_by_site(out: Path, pid: int, source: str = "malloc") -> pd.DataFrame:
    """Last snapshot of a process, one row per stack, with the innermost function as `site_fn`."""
    from analysis.dataset import latest_outstanding, read_table
    df = latest_outstanding(out, [pid])
    df = df[df["source"] == source]
    frames = read_table(out, "frames")
    top = frames[frames["depth"] == 0][["stack_id", "function"]].drop_duplicates("stack_id")
    return df.merge(top.rename(columns={"function": "site_fn"}), on="stack_id", how="left")



def outstanding_through(out: Path, pid: int | list[int], function: str, source: str | None = None) -> float:
    """Outstanding bytes of `pid`'s stacks (of `source`, or all) that pass through `function`, at its
    last snapshot (summed over the processes when `pid` is a list)."""
    from analysis.dataset import latest_outstanding, read_table
    df = latest_outstanding(out, pid if isinstance(pid, list) else [pid])
    if source is not None:
        df = df[df["source"] == source]
    frames = read_table(out, "frames")
    stacks = set(frames[frames["function"] == function]["stack_id"])
    return float(df[df["stack_id"].isin(stacks)]["outstanding_bytes"].sum())

# -- recordings of the leaky driver that several modules only read ---------------------------------
# Each recording costs a BPF compile (~11 CPU-s) and its workload: test_pprof, test_querying and
# test_diff share these two, recorded once per session. Tests must not write into them (exports go
# to the test's own tmp_path); teardown checks that nothing there changed.

@dataclass
class Recorded:
    out: Path
    pid: int
    truth: dict[str, int]        # workload function -> bytes it left allocated (or churned)
    boundaries: list[float]      # wall time after each phase's events reached a snapshot


def record_leaky(out: Path, lib: Path, phases: list[list[tuple]]) -> Recorded:
    """Record the leaky driver running `phases` of calls ((function, *args) tuples). After each
    phase two snapshots pass, so that every event of the phase is in a snapshot taken before the
    boundary time noted, and nothing of the next phase is."""
    w = Workload(lib)
    rec = Recording(out, "--pid", str(w.pid), "-i", "1")
    truth: dict[str, int] = {}
    boundaries: list[float] = []
    try:
        rec.wait_attached()
        for calls in phases:
            for name, *args in calls:
                truth[name] = truth.get(name, 0) + w.call(name, *args)
            done = time.time()
            rec.wait_snapshot(done)
            rec.wait_snapshot(time.time())
            boundaries.append(time.time())
        code, _, err = rec.stop()
        assert code == 0, err
    finally:
        if rec.proc.poll() is None:
            rec.proc.kill()
            rec.proc.wait()
        w.close()
    return Recorded(out, w.pid, truth, boundaries)


def _tree(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.fixture(scope="session")
def leaky(tmp_path_factory, leaky_lib, bpf_ready):
    """Phase 1: leak_malloc leaks 32 MiB, churn churns 32 MiB; phase 2 (after boundaries[0]):
    leak_calloc leaks 16 MiB. The baseline of test_diff."""
    r = record_leaky(tmp_path_factory.mktemp("leaky_rec") / "rec", leaky_lib, [
        [("leak_malloc", 8192, 4096), ("churn", 8192, 4096)],
        [("leak_calloc", 256, 65536)],
    ])
    r.truth["churn"] = 8192 * 4096
    before = _tree(r.out)
    yield r
    assert _tree(r.out) == before, "a test wrote into the shared recording"


@pytest.fixture(scope="session")
def leaky_grown(tmp_path_factory, leaky_lib, bpf_ready):
    """`leaky` grown, test_diff's new run and test_querying's second host: leak_malloc leaks
    128 MiB (4x), leak_posix_memalign 16 MiB (new), leak_calloc nothing (gone), the same churn."""
    r = record_leaky(tmp_path_factory.mktemp("leaky_grown") / "rec", leaky_lib, [[
        ("leak_malloc", 32768, 4096),
        ("leak_posix_memalign", 1024, 64, 16384),
        ("churn", 8192, 4096),
    ]])
    r.truth["churn"] = 8192 * 4096
    before = _tree(r.out)
    yield r
    assert _tree(r.out) == before, "a test wrote into the shared recording"


@pytest.fixture
def memory_ceiling():
    """A cgroup (v1 memory controller) whose limit is the unit's MemoryMax (576M): processes put in
    it are killed by the kernel, not warned, when they pass it."""
    cg = Path(f"/sys/fs/cgroup/memory/allocsampler-test-{os.getpid()}")
    cg.mkdir(exist_ok=True)
    (cg / "memory.limit_in_bytes").write_text(str(576 << 20))
    yield cg
    for pid in (cg / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            os.kill(int(pid), 9)
    deadline = time.monotonic() + 10
    while (cg / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    cg.rmdir()


@contextlib.contextmanager
def tmpfs_at(path: Path, size: str):
    """A small tmpfs mounted at `path` (made here) for disk-full tests, unmounted after (we are root)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
