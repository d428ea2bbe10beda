"""What one allocator probe hit costs the target on this host, measured at start-up.

A child interpreter runs a malloc/free loop through ctypes, alternately without and with our
allocator probes attached (the same programs, sites and mode the targets get); the extra time
divided by the probe hits is the cost per hit. It depends on the kernel, its mitigations, the
libc (which instruction each probe site has) and the probe mode, so it is cached per boot,
kernel, libc build-id and mode.

Every target has its own probe links, filtered to its pid, and the kernel runs every link of a
probed address at each hit: a hit in one target also pays for the links of the other targets
on the same library (~35 ns each here, measured by scripts/bench_targets.py). That share is
calibrated too, with EXTRA_LINKS links of an idle process added, and the governor adds it per
co-attached target.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from sampler import files
from sampler.binary.reader import ElfFormatError, ElfReader
from sampler.probes.allocators import FAMILIES, find_allocators
from sampler.proc.maps import read_maps

PAIRS = 40_000
ROUNDS = 3
EXTRA_LINKS = 8
# Fallbacks when calibration cannot run: the attach tier's measured costs here (uprobe-costs.md,
# scripts/bench_targets.py).
DEFAULT_NS = 1500.0
DEFAULT_LINK_NS = 35.0

# Both children die with the recorder (PR_SET_PDEATHSIG), a SIGKILLed one included.
_DIE_WITH_PARENT = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
"""
_IDLE = _DIE_WITH_PARENT + "import time\ntime.sleep(600)\n"
_CHILD = _DIE_WITH_PARENT + r"""
import time
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
m, f, n = libc.malloc, libc.free, int(sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    for _ in range(n):
        f(m(64))
    print(time.perf_counter() - t, flush=True)
"""


def _key(probes, build_id: str | None) -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"2|{os.uname().release}|{boot}|{build_id}|{'session' if probes.session else 'perf'}"


def _own_libc() -> str | None:
    """The build-id of the libc this process maps: the calibration child (this Python) maps the
    same one, so a cached cost is found without starting it and planning its probes."""
    glibc = next(f for f in FAMILIES if f.name == "glibc")
    for m in read_maps(os.getpid()):
        if glibc.library.match(os.path.basename(m.path)):
            with contextlib.suppress(OSError, ElfFormatError):
                return ElfReader.open(m.path).build_id()
    return None


def calibrate(probes, cache_dir: Path | None) -> tuple[float, float, str]:
    """(ns per probe hit, ns per hit and other link on the address, how they were obtained).
    Never raises: falls back to the defaults."""
    cache = cache_dir / "probe-cost.json" if cache_dir else None
    known = _load(cache)
    if (got := _cached(known, _key(probes, _own_libc()))) is not None:
        return got[0], got[1], "calibrated earlier this boot"
    # isolated (-I) and in /: `python -c` imports from its working directory first (sampler/environ.py)
    child = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, str(os.getpid()), str(PAIRS)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd="/")
    idle = None
    try:
        if child.stdout.readline().strip() != "ready":
            return DEFAULT_NS, DEFAULT_LINK_NS, "default (calibration child failed)"
        libs, _ = find_allocators(child.pid)
        libc = next((lib for lib in libs if lib.family == "glibc"), None)
        if libc is None:
            return DEFAULT_NS, DEFAULT_LINK_NS, "default (no glibc to calibrate on)"
        key = _key(probes, libc.build_id)
        if (got := _cached(known, key)) is not None:
            return got[0], got[1], "calibrated earlier this boot"

        def run() -> float:
            child.stdin.write("go\n")
            child.stdin.flush()
            return float(child.stdout.readline())

        def probed_run() -> tuple[float, int]:
            h0 = sum(probes.hits().get(child.pid, (0, 0)))
            t = run()
            return t, sum(probes.hits().get(child.pid, (0, 0))) - h0

        # links of another process on the same functions: it never runs them (it sleeps)
        idle = subprocess.Popen([sys.executable, "-I", "-c", _IDLE, str(os.getpid())], cwd="/")
        run()                                                  # warm-up
        per_hit, per_link = [], []
        for _ in range(ROUNDS):
            plain = run()
            probes.attach(child.pid, libc)
            alone, hits = probed_run()
            for _ in range(EXTRA_LINKS):
                probes.attach(idle.pid, libc)
            shared, hits2 = probed_run()
            probes.detach_probes(idle.pid)
            probes.detach_probes(child.pid)
            if hits > 0 and hits2 > 0:
                per_hit.append((alone - plain) * 1e9 / hits)
                per_link.append((shared / hits2 - alone / hits) * 1e9 / EXTRA_LINKS)
        if not per_hit:
            return DEFAULT_NS, DEFAULT_LINK_NS, "default (no probe hits while calibrating)"
        ns = max(100.0, statistics.median(per_hit))
        link_ns = max(0.0, statistics.median(per_link))
        if cache is not None:
            known[key] = [round(ns, 1), round(link_ns, 1)]
            _store(cache, known)
        return ns, link_ns, f"calibrated ({ROUNDS} x {PAIRS} malloc/free pairs)"
    except (OSError, ValueError) as e:
        return DEFAULT_NS, DEFAULT_LINK_NS, f"default (calibration failed: {e})"
    finally:
        if idle is not None:
            probes.detach(idle.pid)
            idle.kill()
            idle.wait()
        probes.detach(child.pid)
        child.stdin.close()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        probes.forget_pid(child.pid)


def _cached(known: dict, key: str) -> tuple[float, float] | None:
    got = known.get(key)
    if isinstance(got, list) and len(got) == 2 and all(isinstance(v, (int, float)) and 0 <= v < 1e6 for v in got):
        return float(got[0]), float(got[1])
    return None


def _load(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(files.read_private(path, 1 << 20))
    except (OSError, ValueError):
        return {}           # absent, damaged or not ours alone (a planted file could turn the governor off)
    return data if isinstance(data, dict) else {}


def _store(path: Path, data: dict) -> None:
    with contextlib.suppress(OSError):
        files.write_atomic(path, json.dumps(data).encode())
