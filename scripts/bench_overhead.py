#!/usr/bin/env python3
"""Overhead of `allocsampler record --pid` on allocation-heavy workloads, next to bcc's memleak.

Run as root from the project's virtual environment:

    sudo .venv/bin/python scripts/bench_overhead.py [--rounds 5] [--markdown docs/performance.md]

Two workloads, each timing its own loop with CLOCK_MONOTONIC after a go byte on stdin (so process
start-up, BPF compilation and attaching are never inside the measured time):

  c       a C malloc/free loop (gcc -O2, -fno-builtin so the pair cannot be elided, a volatile
          sink), sizes cycling over 16..4096 bytes: the worst case, every call hits a probe;
  python  json dumps/loads of dicts, bytes objects > 512 B (which bypass pymalloc and reach libc),
          dict and list growth: an allocation-heavy interpreter loop.

Variants, run interleaved (round r: A B C, A B C, ...; one warm-up round first, discarded):

  unprobed        nothing attached
  allocsampler    allocsampler record --pid PID --probe-mode session (the default tier)
  allocsampler-perf  allocsampler record --pid PID --probe-mode perf (only with --variants)
  memleak         memleak-bpfcc -p PID -T 5 (bcc's tool with its defaults; -T only trims output)

Readiness (the workload is released only when its probes are really in place):
  * the go byte is withheld until every probe site is patched in the target's memory: the
    target's libc text, read through /proc/PID/mem, differs from the file exactly where the
    kernel wrote its breakpoints (int3, or the call of an optimized uprobe);
  * allocsampler: DIR/targets/date=*/*.parquet exists (written after attaching) and every probe
    site that its targets row lists (e.g. "free+9") is patched;
  * memleak: it printed "Attaching to pid" and the entry of munmap, the last function that it
    attaches, is patched.

Reported per workload and variant: the median loop time, the ratio of medians to unprobed, the
overhead in %, our overhead divided by memleak's; for allocsampler the probe hits per second of
loop and the recorder's own CPU seconds and peak RSS from DIR/recorder; for both tools their CPU
seconds while the loop ran and their peak RSS (VmHWM), from /proc.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import glob
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

C_SOURCE = r"""
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static const size_t sizes[] = {16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096};
#define NSIZES (sizeof sizes / sizeof sizes[0])
volatile uintptr_t sink;

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    char go = 0;
    struct timespec a, b;
    printf("ready\n");
    fflush(stdout);
    if (read(0, &go, 1) != 1 || go != 'g')
        return 2;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        char *p = malloc(sizes[i % NSIZES]);
        if (!p)
            return 3;
        p[0] = (char)i;
        sink = (uintptr_t)p + (unsigned char)p[0];
        free(p);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("elapsed_s %.9f ops %ld\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9, n);
    return 0;
}
"""

PY_SOURCE = r'''
import json
import sys
import time


def main():
    iters = int(sys.argv[1])
    base = [{"id": j, "name": "item-%d" % j, "tags": ["t%d" % (j % 7), "u%d" % (j % 11)],
             "score": j * 0.5, "payload": "x" * (j % 90)} for j in range(24)]
    cache = {}
    sink = 0
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if sys.stdin.buffer.read(1) != b"g":
        sys.exit(2)
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    for i in range(iters):
        doc = {"seq": i, "items": base, "meta": {"k%d" % k: k * i for k in range(20)}}
        s = json.dumps(doc)                        # a few KiB of str: libc
        back = json.loads(s)
        sink += len(back["items"])
        blobs = [bytes(600 + (i * 131 + k * 977) % 3500) for k in range(6)]   # > 512 B: libc
        cache[i % 512] = blobs[i % 6]              # churn: entries replaced and dropped
        if len(cache) > 256:
            cache.pop((i - 256) % 512, None)
        lst = []
        for k in range(150):                       # list growth past 512 B: realloc in libc
            lst.append(k)
        d = {}
        for k in range(48):                        # dict resizes: big key tables in libc
            d[k] = k
        sink += len(lst) + len(d) + len(s)
    t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    print("elapsed_s %.9f ops %d sink %d" % ((t1 - t0) / 1e9, iters, sink), flush=True)


main()
'''

ALL_VARIANTS = ("unprobed", "allocsampler", "allocsampler-perf", "memleak")
DEFAULT_VARIANTS = ("unprobed", "allocsampler", "memleak")


class BenchError(RuntimeError):
    pass


class AttachConflict(BenchError):
    """The kernel refused a uprobe with EINVAL: most likely another tool holds a uprobe on the same
    libc function registered with another ref_ctr_offset (bcc's Python binding passes garbage
    there, iovisor/bcc#5236; `dmesg` then shows "ref_ctr_offset mismatch")."""


# --- probes in the target's memory ------------------------------------------------------------
@dataclass
class _Text:
    path: str
    start: int       # address of the executable mapping
    end: int
    offset: int      # its file offset


def _libc_text(pid: int) -> _Text:
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or "x" not in parts[1]:
                continue
            path = parts[5].strip()
            if re.search(r"/libc(\.so\.6|-[\d.]+\.so)$", path):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                return _Text(path, start, end, int(parts[2], 16))
    raise BenchError(f"pid {pid}: no executable libc mapping")


def patched_offsets(pid: int, text: _Text) -> set[int]:
    """File offsets in libc's text where the target's memory differs from the file: the
    breakpoints that uprobes installed in this process."""
    import numpy as np

    n = text.end - text.start
    with open(text.path, "rb") as f:
        f.seek(text.offset)
        disk = f.read(n)
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(text.start)
        mem = f.read(len(disk))
    a = np.frombuffer(disk, dtype=np.uint8)
    b = np.frombuffer(mem, dtype=np.uint8)
    m = min(len(a), len(b))
    return {text.offset + int(i) for i in np.nonzero(a[:m] != b[:m])[0]}


class LibcSymbols:
    """Dynamic symbols of a libc file as file offsets."""

    def __init__(self, path: str):
        from elftools.elf.elffile import ELFFile

        self.offsets: dict[str, int] = {}
        with open(path, "rb") as f:
            elf = ELFFile(f)
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            dynsym = elf.get_section_by_name(".dynsym")
            for sym in dynsym.iter_symbols():
                if sym["st_info"]["type"] != "STT_FUNC" or not sym["st_value"]:
                    continue
                v = sym["st_value"]
                for seg in loads:
                    if seg["p_vaddr"] <= v < seg["p_vaddr"] + seg["p_filesz"]:
                        name = sym.name.split("@")[0]
                        self.offsets.setdefault(name, v - seg["p_vaddr"] + seg["p_offset"])
                        break

    def patched(self, name: str, off: int, diffs: set[int]) -> bool | None:
        """True if the probe site name+off is patched; None if name is unknown."""
        base = self.offsets.get(name)
        if base is None:
            return None
        site = base + off
        return any(site + k in diffs for k in range(5))   # int3 (1 byte) or an optimized call (5)


# --- processes --------------------------------------------------------------------------------
def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGINT, wait: float = 20.0) -> int | None:
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@dataclass
class Run:
    workload: str
    variant: str
    round: int
    loop_s: float
    ops: int
    probe_hits: int | None = None
    samples: int | None = None
    recorder_cpu_s: float | None = None      # sum of DIR/recorder cpu_s
    recorder_rss: int | None = None          # max of DIR/recorder rss
    tool_cpu_s: float | None = None          # tool's CPU seconds from release to the loop's end (/proc)
    tool_hwm: int | None = None              # tool's VmHWM
    probe_sites: int | None = None           # patched libc sites seen at release
    extra: dict = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.c_exe = tmp / "malloc_loop"
        self.py_script = tmp / "py_workload.py"
        self._symbols: dict[str, LibcSymbols] = {}
        self.seq = 0

    # workloads --------------------------------------------------------------------------------
    def build(self) -> None:
        src = self.tmp / "malloc_loop.c"
        src.write_text(C_SOURCE)
        subprocess.run(["gcc", "-O2", "-fno-builtin-malloc", "-fno-builtin-free", "-o", str(self.c_exe),
                        str(src)], check=True)
        self.py_script.write_text(PY_SOURCE)

    def workload_argv(self, workload: str, n: int) -> list[str]:
        if workload == "c":
            return [str(self.c_exe), str(n)]
        return [sys.executable, "-I", str(self.py_script), str(n)]

    def start_workload(self, argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        line = proc.stdout.readline()
        if line.strip() != b"ready":
            _stop(proc, signal.SIGKILL)
            raise BenchError(f"workload {argv} did not start: {line!r}")
        return proc

    def symbols(self, path: str) -> LibcSymbols:
        if path not in self._symbols:
            self._symbols[path] = LibcSymbols(path)
        return self._symbols[path]

    # one run ----------------------------------------------------------------------------------
    def run_once(self, workload: str, variant: str, n: int, rnd: int) -> Run:
        self.seq += 1
        rundir = self.tmp / f"run{self.seq:03d}-{workload}-{variant}"
        rundir.mkdir()
        log = rundir / "tool.log"
        work = tool = None
        logf = None
        try:
            work = self.start_workload(self.workload_argv(workload, n))
            text = _libc_text(work.pid)
            sites = None
            retries = 0
            while variant != "unprobed":
                logf = open(log, "wb")   # noqa: SIM115 - closed in finally
                tool = self.start_tool(variant, work.pid, rundir, logf)
                try:
                    sites = self.wait_ready(variant, work.pid, text, tool, rundir, log)
                    break
                except AttachConflict as e:
                    # Another uprobe user on this libc (other sessions, tests) registered the same
                    # function with a different ref_ctr_offset: the kernel refuses ours (EINVAL).
                    retries += 1
                    if retries > self.args.attach_retries:
                        raise BenchError(f"{variant}: gave up after {retries} attach conflicts:\n{e}") from None
                    print(f"  {variant}: attach conflict (EINVAL), retry {retries} in "
                          f"{self.args.retry_wait:g} s", file=sys.stderr)
                    _stop(tool, signal.SIGINT, 20)
                    logf.close()
                    shutil.rmtree(rundir / "out", ignore_errors=True)
                    time.sleep(self.args.retry_wait)
            cpu0 = _cpu_s(tool.pid) if tool else None
            work.stdin.write(b"g")
            work.stdin.close()
            cpu1 = hwm = None
            while True:      # poll the tool's CPU while the loop runs: its value at the loop's end
                if tool is not None:
                    cpu1 = _cpu_s(tool.pid) if tool.poll() is None else cpu1
                    hwm = _vm_hwm(tool.pid) or hwm
                try:
                    work.wait(0.1 if tool is not None else None)
                    break
                except subprocess.TimeoutExpired:
                    continue
            out = work.stdout.read().decode()
            if work.returncode != 0:
                raise BenchError(f"workload {workload} exited {work.returncode}: {out!r}")
            m = re.search(r"elapsed_s ([\d.]+) ops (\d+)", out)
            if not m:
                raise BenchError(f"workload {workload}: no timing in {out!r}")
            r = Run(workload, variant, rnd, float(m.group(1)), int(m.group(2)), tool_hwm=hwm,
                    probe_sites=sites)
            r.extra["attach_retries"] = retries
            if cpu0 is not None and cpu1 is not None:
                r.tool_cpu_s = cpu1 - cpu0
            if tool is not None:
                self.stop_tool(variant, tool, log)
                if variant.startswith("allocsampler"):
                    self.read_recorder(r, rundir / "out")
            return r
        finally:
            _stop(work, signal.SIGKILL, 5)
            _stop(tool, signal.SIGINT, 20)
            if logf is not None:
                logf.close()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    def start_tool(self, variant: str, pid: int, rundir: Path, logf) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if variant.startswith("allocsampler"):
            mode = "perf" if variant.endswith("perf") else "session"
            argv = [*self.args.allocsampler_cmd, "record", "--pid", str(pid), "-o", str(rundir / "out"),
                    "--probe-mode", mode, "-q"]
            if self.args.interval:
                argv += ["-i", str(self.args.interval)]
        else:
            argv = [self.args.memleak, "-p", str(pid), "-T", "5"]
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)

    def wait_ready(self, variant: str, pid: int, text: _Text, tool: subprocess.Popen, rundir: Path,
                   log: Path) -> int:
        syms = self.symbols(text.path)
        deadline = time.monotonic() + self.args.attach_timeout
        why = "nothing yet"
        while time.monotonic() < deadline:
            if tool.poll() is not None:
                msg = f"{variant} exited {tool.returncode} before it attached:\n{_tail(log)}"
                raise (AttachConflict if "Invalid argument" in _tail(log, 100000) else BenchError)(msg)
            diffs = patched_offsets(pid, text)
            if variant.startswith("allocsampler"):
                files = glob.glob(str(rundir / "out" / "targets" / "date=*" / "*.parquet"))
                if files:
                    ok, why = self._sampler_sites_patched(files, syms, diffs)
                    if ok:
                        return len(diffs)
                else:
                    why = "no targets file yet"
            else:
                if "Attaching to pid" in _tail(log, 100000):
                    done = syms.patched("munmap", 0, diffs)
                    if done:
                        return len(diffs)
                    why = "munmap not patched yet"
                else:
                    why = "no 'Attaching to pid' line yet"
            time.sleep(0.05)
        raise BenchError(f"{variant} not attached after {self.args.attach_timeout} s ({why}):\n{_tail(log)}")

    @staticmethod
    def _sampler_sites_patched(files: list[str], syms: LibcSymbols, diffs: set[int]) -> tuple[bool, str]:
        import pandas as pd

        rows = pd.concat([pd.read_parquet(f) for f in files])
        attach = rows[rows["event"] == "attach"]
        if attach.empty:
            return False, "no attach row yet"
        probes = [p for ps in attach["probes"] for p in ps]
        if not probes:
            return False, "attach row lists no probes"
        missing = []
        for p in probes:
            m = re.match(r"([\w.]+)\+(\d+)", p)
            if not m:
                continue
            ok = syms.patched(m.group(1), int(m.group(2)), diffs)
            if ok is False:
                missing.append(p)
        if missing:
            return False, "not patched yet: " + ", ".join(missing)
        return bool(diffs), "no patched site" if not diffs else ""

    def stop_tool(self, variant: str, tool: subprocess.Popen, log: Path) -> None:
        if variant.startswith("allocsampler"):
            try:     # it ends by itself when its only target exits
                rc = tool.wait(self.args.stop_timeout)
            except subprocess.TimeoutExpired:
                rc = _stop(tool, signal.SIGINT, self.args.stop_timeout)
        else:
            rc = _stop(tool, signal.SIGINT, self.args.stop_timeout)
        if rc not in (0, None) and not (variant == "memleak" and rc in (-signal.SIGINT, 130)):
            raise BenchError(f"{variant} exited {rc}:\n{_tail(log)}")

    @staticmethod
    def read_recorder(r: Run, out: Path) -> None:
        import pandas as pd

        rec = pd.read_parquet(out / "recorder")
        if rec.empty:
            raise BenchError(f"{out}/recorder is empty")
        r.probe_hits = int(rec["probe_hits"].sum())
        r.samples = int(rec["samples"].sum())
        r.recorder_cpu_s = float(rec["cpu_s"].sum())
        r.recorder_rss = int(rec["rss"].max())
        r.extra["lost_events"] = int(rec["lost_events"].sum())
        r.extra["dropped_samples"] = int(rec["dropped_samples"].sum())

    # calibration ------------------------------------------------------------------------------
    def calibrate_py(self, seconds: float) -> int:
        n = 2000
        for _ in range(4):
            t = self.run_once("python", "unprobed", n, -1).loop_s
            if t > 0.4:
                break
            n *= 4
        return max(100, int(n * seconds / t))


# --- report -----------------------------------------------------------------------------------
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(v, spec: str, none: str = "–") -> str:
    return none if v is None else format(v, spec)


def summarize(runs: list[Run], workloads: list[str], variants: list[str]) -> tuple[list[dict], dict]:
    rows = []
    verdict = {}
    for w in workloads:
        med = {v: _median([r.loop_s for r in runs if r.workload == w and r.variant == v]) for v in variants}
        base = med.get("unprobed")
        ovh = {v: (med[v] / base - 1) if base and med[v] else None for v in variants}
        ml = ovh.get("memleak")
        for v in variants:
            rs = [r for r in runs if r.workload == w and r.variant == v]
            if not rs:
                continue
            hits = _median([r.probe_hits / r.loop_s if r.probe_hits is not None else None for r in rs])
            hits_run = _median([r.probe_hits for r in rs])
            per_hit = ((med[v] - base) / hits_run * 1e9) if hits_run and base else None
            vs_ml = (ovh[v] / ml) if (v.startswith("allocsampler") and ml and ovh[v] is not None) else None
            if v == "allocsampler" and vs_ml is not None:
                verdict[w] = vs_ml
            rows.append({
                "workload": w, "variant": v, "n": len(rs), "ops": rs[0].ops, "median_s": med[v],
                "ratio": (med[v] / base) if base else None, "overhead": ovh[v], "vs_memleak": vs_ml,
                "hits_per_s": hits, "ns_per_hit": per_hit,
                "samples": _median([r.samples for r in rs]),
                "rec_cpu": _median([r.recorder_cpu_s for r in rs]),
                "rec_rss": _median([r.recorder_rss for r in rs]),
                "tool_cpu": _median([r.tool_cpu_s for r in rs]),
                "tool_hwm": _median([r.tool_hwm for r in rs]),
                "sites": _median([r.probe_sites for r in rs]),
                "times": [r.loop_s for r in sorted(rs, key=lambda r: r.round)],
            })
    return rows, verdict


def markdown(rows: list[dict], verdict: dict, meta: dict) -> str:
    mib = 1 << 20
    out = [
        "| workload | variant | median loop s | ratio vs unprobed | overhead | our overhead / memleak's "
        "| probe hits/s | added ns per hit | tool CPU s in loop | tool peak RSS MiB "
        "| recorder cpu_s (sum) | recorder rss MiB (max) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        out.append("| " + " | ".join([
            r["workload"], r["variant"], _fmt(r["median_s"], ".3f"), _fmt(r["ratio"], ".3f"),
            _fmt(None if r["variant"] == "unprobed" else r["overhead"] and r["overhead"] * 100, "+.1f")
            + ("%" if r["variant"] != "unprobed" else ""),
            _fmt(r["vs_memleak"], ".3f"),
            _fmt(r["hits_per_s"], ",.0f"), _fmt(r["ns_per_hit"], ",.0f"),
            _fmt(r["tool_cpu"], ".2f"), _fmt(r["tool_hwm"] and r["tool_hwm"] / mib, ".0f"),
            _fmt(r["rec_cpu"], ".2f"), _fmt(r["rec_rss"] and r["rec_rss"] / mib, ".0f"),
        ]) + " |")
    out.append("")
    out.append("Loop times per round (s), warm-up round excluded:")
    out.append("")
    for r in rows:
        out.append(f"- {r['workload']} / {r['variant']} ({r['ops']:,} ops): "
                   + ", ".join(f"{t:.3f}" for t in r["times"]))
    out.append("")
    for w, v in verdict.items():
        ok = "meets" if v <= 0.5 else "does NOT meet"
        out.append(f"- {w}: allocsampler's overhead is {v:.2f}x memleak's: {ok} the target (<= 0.5x).")
    out.append("")
    out.append("Machine and run:")
    out.append("")
    for k, v in meta.items():
        out.append(f"- {k}: {v}")
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- bench_overhead:begin -->", "<!-- bench_overhead:end -->"


def write_markdown(path: Path, text: str) -> None:
    """Replace the block between the markers if the file has them, else write the file."""
    block = f"{BEGIN}\n{text}{END}\n"
    if path.exists():
        old = path.read_text()
        if BEGIN in old and END in old:
            head, rest = old.split(BEGIN, 1)
            tail = rest.split(END, 1)[1].lstrip("\n")
            path.write_text(head + block + ("\n" + tail if tail else ""))
            return
    path.write_text("# allocsampler overhead (scripts/bench_overhead.py)\n\n" + block)


def machine_meta(args, argv: list[str], started: dt.datetime, load0) -> dict:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        glibc = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError):
        glibc = "?"
    bcc = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "python3-bpfcc"], capture_output=True,
                         text=True).stdout or "?"
    return {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "kernel": platform.release(),
        "CPUs": f"{os.cpu_count()} x {cpu}",
        "glibc": glibc, "python (workload)": platform.python_version(), "bcc": bcc,
        "load average before / after": f"{load0[0]:.2f} / {os.getloadavg()[0]:.2f}",
        "command": " ".join(argv),
        "rounds": f"{args.rounds} (+1 warm-up, discarded), order per round: {', '.join(args.variants)}",
    }


# --- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (default: %(default)s)")
    p.add_argument("--c-pairs", type=int, default=500_000,
                   help="malloc/free pairs of the C loop (default: %(default)s)")
    p.add_argument("--py-seconds", type=float, default=3.0,
                   help="calibrate the Python loop to about this many unprobed seconds "
                   "(default: %(default)s)")
    p.add_argument("--py-iters", type=int, help="Python loop iterations (instead of calibrating)")
    p.add_argument("--workloads", default="c,python", help="comma-separated: c,python (default: %(default)s)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {','.join(ALL_VARIANTS)} (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 round: a smoke test")
    p.add_argument("--interval", type=float, help="allocsampler -i (default: the tool's default)")
    p.add_argument("--allocsampler", help="allocsampler executable (default: the repo's .venv one)")
    p.add_argument("--memleak", default=shutil.which("memleak-bpfcc") or "/usr/sbin/memleak-bpfcc")
    p.add_argument("--attach-timeout", type=float, default=60.0)
    p.add_argument("--stop-timeout", type=float, default=30.0)
    p.add_argument("--attach-retries", type=int, default=10,
                   help="retries when a tool's uprobe is refused with EINVAL (default: %(default)s)")
    p.add_argument("--retry-wait", type=float, default=3.0)
    p.add_argument("--markdown", type=Path, help="also write the results here (replaces the block between "
                   f"{BEGIN} and {END} if the file has them)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (datasets, logs)")
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if bad := [v for v in a.variants if v not in ALL_VARIANTS]:
        p.error(f"unknown variants {bad}; choose from {ALL_VARIANTS}")
    if bad := [w for w in a.workloads if w not in ("c", "python")]:
        p.error(f"unknown workloads {bad}")
    if a.quick:
        a.rounds = 1
        a.c_pairs = min(a.c_pairs, 20_000)
        a.py_iters = a.py_iters or 300
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    exe = a.allocsampler or REPO / ".venv" / "bin" / "allocsampler"
    a.allocsampler_cmd = [str(exe)] if Path(exe).exists() else [sys.executable, "-m", "sampler.cli"]
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_overhead: run as root (BPF)", file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc)
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench_overhead."))
    runs: list[Run] = []
    try:
        bench = Bench(args, tmp)
        bench.build()
        sizes = {"c": args.c_pairs}
        if "python" in args.workloads:
            sizes["python"] = args.py_iters or bench.calibrate_py(args.py_seconds)
        for w in args.workloads:
            print(f"# {w}: {sizes[w]:,} ops per run", file=sys.stderr)
        for rnd in range(args.rounds + 1):
            for w in args.workloads:
                for v in args.variants:
                    r = bench.run_once(w, v, sizes[w], rnd)
                    tag = "warm-up" if rnd == 0 else f"round {rnd}"
                    more = f" hits={r.probe_hits:,}" if r.probe_hits is not None else ""
                    print(f"{tag:>8} {w:>6} {v:<18} {r.loop_s:8.3f} s{more}", file=sys.stderr)
                    if rnd > 0:
                        runs.append(r)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BenchError as e:
        print(f"bench_overhead: error: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    rows, verdict = summarize(runs, args.workloads, args.variants)
    text = markdown(rows, verdict, machine_meta(args, sys.argv, started, load0))
    print(text)
    if args.markdown:
        write_markdown(args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
