"""What one allocator probe hit costs the target on this host, measured at start-up.

A child interpreter runs a malloc/free loop through ctypes, alternately without and with our
allocator probes attached (the same programs, sites and mode the targets get); the extra time
divided by the probe hits is the cost per hit. It depends on the kernel, its mitigations, the
libc (which instruction each probe site has) and the probe mode, so it is cached per boot,
kernel, libc build-id and mode.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .allocators import find_allocators

PAIRS = 40_000
ROUNDS = 3
# Fallback when calibration cannot run: the attach tier's measured cost here (uprobe-costs.md).
DEFAULT_NS = 1500.0

_CHILD = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
m, f, n = libc.malloc, libc.free, int(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    for _ in range(n):
        f(m(64))
    print(time.perf_counter() - t, flush=True)
"""


def _key(probes, lib) -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{os.uname().release}|{boot}|{lib.build_id}|{'session' if probes.session else 'perf'}"


def calibrate(probes, cache_dir: Path | None) -> tuple[float, str]:
    """(ns per probe hit, how it was obtained). Never raises: falls back to DEFAULT_NS."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(PAIRS)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            return DEFAULT_NS, "default (calibration child failed)"
        libs, _ = find_allocators(child.pid)
        libc = next((lib for lib in libs if lib.family == "glibc"), None)
        if libc is None:
            return DEFAULT_NS, "default (no glibc to calibrate on)"
        cache = cache_dir / "probe-cost.json" if cache_dir else None
        key = _key(probes, libc)
        known = _load(cache)
        if key in known:
            return float(known[key]), "calibrated earlier this boot"

        def run() -> float:
            child.stdin.write("go\n")
            child.stdin.flush()
            return float(child.stdout.readline())

        run()                                                  # warm-up
        plain, probed, hits = [], [], []
        for _ in range(ROUNDS):
            plain.append(run())
            probes.attach(child.pid, libc)
            h0 = sum(probes.hits().get(child.pid, (0, 0)))
            probed.append(run())
            hits.append(sum(probes.hits().get(child.pid, (0, 0))) - h0)
            probes.detach_probes(child.pid)
        per_hit = [(b - a) * 1e9 / h for a, b, h in zip(plain, probed, hits, strict=True) if h > 0]
        if not per_hit:
            return DEFAULT_NS, "default (no probe hits while calibrating)"
        ns = max(100.0, statistics.median(per_hit))
        if cache is not None:
            known[key] = round(ns, 1)
            _store(cache, known)
        return ns, f"calibrated ({ROUNDS} x {PAIRS} malloc/free pairs)"
    except (OSError, ValueError) as e:
        return DEFAULT_NS, f"default (calibration failed: {e})"
    finally:
        probes.detach(child.pid)
        child.stdin.close()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        probes.forget_pid(child.pid)


def _load(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _store(path: Path, data: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)

