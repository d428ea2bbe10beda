#!/usr/bin/env python3
"""Cost of readable stacks: record bytes per sample and the recorder's CPU per sample.

Run as root from the project's virtual environment:

    sudo .venv/bin/python scripts/bench_stacks.py [--workload ext|torch|both] [--unwind bpf|user|both]
                                                  [--samples 2000] [--quick]

--unwind bpf (the recorder's default): native stacks are walked in BPF from compact CFI rows
(sampler/stacks/kernel_tables.py), loaded before the workload starts allocating; records carry
the walked pcs. --unwind user: records carry a copy of the stack, unwound in Python (as before).
For bpf, a further pass "first sight" records the same workload with an empty rows cache and
does not wait for the rows: samples whose files are still being built are handed over to user
space (a stack copy from that frame), which is what the first seconds after attaching cost.

For each workload (tests/workloads/py_leak.py: a -O2 -fomit-frame-pointer C extension called
from three Python functions, or torch CPU tensor allocations), the BPF programs are attached to
the live process with a small sampling mean so that many stacks arrive; the raw records are kept
and then turned into stacks three times while the process waits (its memory stays readable):

  cold     fresh symbolizer and unwinder, empty unwind cache on disk (first sight of the binaries)
  warm     the same objects again (per-PC unwind rules and symbols memoised; stack ids memoised
           by content, so this is the steady state of a long recording)
  restart  new objects, unwind cache loaded from disk (a recorder restart)

Reported: samples, mean and p95 record bytes (header + registers + Python frames + stack copy),
the fraction of stacks that reach the thread's entry, and per-sample microseconds (median, p95).

--quick: both workloads, a tenth of their allocations (~250 samples each instead of ~2,500) and
--samples 200: the same capture and passes in seconds, a smoke test whose numbers mean nothing.
It also compiles the BPF programs once for the run (a cache of its own) rather than at each
workload's attach, and takes the rows the capture waits for from the recorder's unwind cache
(built there once per host, as a recording does; "first sight" still starts from an empty one).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sampler import files  # noqa: E402
from sampler.bpf.abi import EvType  # noqa: E402
from sampler.bpf.events import decode  # noqa: E402
from sampler.bpf.loader import BpfProbes, ProbeConfig  # noqa: E402
from sampler.control.weights import weight_table  # noqa: E402
from sampler.probes.allocators import find_allocators  # noqa: E402
from sampler.python.targets import PythonTargets  # noqa: E402
from sampler.stacks.kernel_tables import KernelTables  # noqa: E402
from sampler.stacks.symbolize import Symbolizer  # noqa: E402
from sampler.stacks.table import COMPLETE, StackTable  # noqa: E402
from sampler.stacks.table_worker import TableWorker  # noqa: E402
from sampler.stacks.unwind import Unwinder  # noqa: E402

WORKLOADS = REPO / "tests" / "workloads"
QUICK_SCALE = 0.1        # of the workloads' allocation counts
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"


def build_ext(d: Path) -> Path:
    inc = sysconfig.get_paths()["include"]
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", f"-I{inc}",
                    "-o", str(d / "leakext.so"), str(WORKLOADS / "leakext.c")], check=True)
    return d


def capture(probes: BpfProbes, raw: list[bytes], argv: list[str], env: dict, samples: int,
            rows_cache: Path | None, wait_rows: bool = True):
    """Attach, (bpf) load the process's files' rows, let it allocate; the raw ALLOC records."""
    raw.clear()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    probes.add_target(proc.pid)
    libs, _ = find_allocators(proc.pid, ())
    for lib in libs:
        probes.attach(proc.pid, lib)
    py = PythonTargets(probes)
    py.add(proc.pid)
    tables = None
    if rows_cache is not None:
        tables = KernelTables(probes, TableWorker(rows_cache))
        tables.track(proc.pid)
        deadline = time.monotonic() + 300
        while wait_rows and tables.worker.pending and time.monotonic() < deadline:
            tables.poll()
            time.sleep(0.05)
        tables.poll()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while len(raw) < samples and time.monotonic() < deadline and proc.poll() is None:
        probes.poll(100)
        if tables is not None:
            tables.poll()
    assert proc.stdout.readline().strip() == "done"
    probes.drain()
    probes.detach(proc.pid)
    if tables is not None:
        tables.close()
    return proc, list(raw), py


def run_pass(table: StackTable, raw: list[bytes]) -> tuple[list[float], int]:
    """Per record: decoding it and interning its stack (unwinding what BPF handed over,
    symbolizing what is new), as the recorder does."""
    times, complete = [], 0
    for b in raw:
        t0 = time.perf_counter()
        table.intern(decode(b))
        times.append((time.perf_counter() - t0) * 1e6)
        complete += table.last_stop == COMPLETE
    return times, complete


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def bench(name: str, argv: list[str], env: dict, samples: int, mean: int, unwind: str,
          bpf_cache: Path | None = None, rows_from: Path | None = None) -> list[str]:
    """`bpf_cache`: the compiled programs kept there (else compiled now); `rows_from`: the rows
    the (waited) capture loads, kept there (else built into a directory of this run)."""
    probes = BpfProbes(ProbeConfig(sample_mean=mean, weight_table=tuple(weight_table()), cache_dir=bpf_cache))
    sink: list[bytes] = []
    probes.open_events(lambda b: sink.append(bytes(b)) if b[0] == EvType.ALLOC else None)
    rows_cache = Path(tempfile.mkdtemp(prefix="rows-")) if unwind == "bpf" else None
    cache = Path(tempfile.mkdtemp(prefix="unwind-cache-"))
    rows = []
    naming: list[tuple[str, int, float]] = []      # (pass, new stacks, ms to name them)
    try:
        captures = [("", True)] + ([("first sight: ", False)] if unwind == "bpf" else [])
        for prefix, wait in captures:
            if rows_cache is not None and not wait:
                shutil.rmtree(rows_cache)
                rows_cache.mkdir(mode=0o700)
            proc, raw, py = capture(probes, sink, argv, env, samples,
                                    rows_from if rows_cache is not None and wait and rows_from else rows_cache, wait)
            try:
                sizes = [len(b) for b in raw]
                sym, unw = Symbolizer(), Unwinder(cache)
                table = StackTable(sym, unw, py)
                labels = ("cold", "warm") if wait else ("cold",)
                for label in labels:
                    times, complete = run_pass(table, raw)
                    rows.append((prefix + label, sizes, times, complete))
                    t0 = time.perf_counter()
                    named = table.drain_new()       # what the snapshot does: name the new stacks
                    if named:
                        naming.append((prefix + label, len(named), (time.perf_counter() - t0) * 1e3))
                if wait:
                    unw.save()
                    table = StackTable(Symbolizer(), Unwinder(cache), py)
                    times, complete = run_pass(table, raw)
                    rows.append(("restart", sizes, times, complete))
            finally:
                proc.stdin.write("bye\n")
                proc.stdin.flush()
                proc.wait(30)
    finally:
        probes.close()
        shutil.rmtree(cache, ignore_errors=True)
        if rows_cache is not None:
            shutil.rmtree(rows_cache, ignore_errors=True)
    for label, n, ms in naming:
        print(f"{name} ({unwind}, {label}): {n} new stacks named at the snapshot in {ms:,.1f} ms "
              f"({ms / n:,.2f} ms each)", file=sys.stderr)
    return [f"| {name} | {unwind} | {label} | {len(times)} | {statistics.mean(sizes):,.0f} | {pct(sizes, 0.95):,} | "
            f"{complete / max(1, len(times)):.1%} | {statistics.median(times):,.1f} | {pct(times, 0.95):,.1f} | "
            f"{max(times):,.0f} |"
            for label, sizes, times, complete in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("ext", "torch", "both"), default="both")
    ap.add_argument("--unwind", choices=("bpf", "user", "both"), default="both")
    ap.add_argument("--samples", type=int, help="wait for at least this many (default 2000, --quick 200)")
    ap.add_argument("--quick", action="store_true", help="a tenth of the allocations: a smoke test")
    args = ap.parse_args()
    if args.samples is None:
        args.samples = 200 if args.quick else 2000
    scale = QUICK_SCALE if args.quick else 1.0
    d = build_ext(Path(tempfile.mkdtemp(prefix="leakext-")))
    env = {"PYTHONPATH": str(d), "PATH": "/usr/bin:/bin"}
    lines = ["| workload | unwind | pass | samples | mean record bytes | p95 bytes | reach entry | median µs/sample "
             "| p95 µs/sample | max µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    modes = ("bpf", "user") if args.unwind == "both" else (args.unwind,)
    py_leak = str(WORKLOADS / "py_leak.py")
    quick = {}
    if args.quick:
        quick = {"bpf_cache": Path(tempfile.mkdtemp(prefix="bpf-cache-")), "rows_from": files.cache_dir("unwind")}
    for unwind in modes:
        if args.workload in ("ext", "both"):
            lines += bench("C ext from Python", [sys.executable, py_leak, "ext", "4096", str(int(40000 * scale))],
                           env, args.samples, 64 << 10, unwind, **quick)
        if args.workload in ("torch", "both"):
            lines += bench("torch CPU", [sys.executable, py_leak, "torch", str(64 << 10), str(int(4000 * scale))],
                           env, args.samples, 64 << 10, unwind, **quick)
    if args.quick:
        shutil.rmtree(quick["bpf_cache"], ignore_errors=True)
        lines.append(QUICK_NOTE)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
