"""The inject tier (sampler/inprocess/inject.py, inject.c, place.c): the sampler placed into running
processes that check their own work, its slots redirected and restored hundreds of times and its
recorder killed midway; the placement's effect on the stopped thread; what is refused; and the
data a recording gets, against the workload's own truth and the uprobe tier."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, WORKLOADS, compile_c, final_by_site

from sampler.inprocess import inject, pydomains
from sampler.probes import usdt
from sampler.proc.process import read_stat

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"     # scripts/setup.sh installs libjemalloc2
MiB = 1 << 20


# -- the ABI with the sampler ---------------------------------------------------------------------

def test_the_sampler_needs_no_relocation_and_has_its_probe_sites():
    code, helper = inject.built()
    relocs = subprocess.run(["readelf", "-rW", str(code)], capture_output=True, text=True, check=True).stdout
    assert "There are no relocations" in relocs
    notes = subprocess.run(["readelf", "-n", str(code)], capture_output=True, text=True, check=True).stdout
    probes = set(re.findall(r"Provider: (\S+)\s+Name: (\S+)", notes))
    assert probes == set(usdt.MEMORY_PROBES)           # every one the recorder reads, no other
    found = usdt.memory_probes(str(code))
    assert {(p.provider, p.name) for p in found} == probes and all(p.semaphore == 0 for p in found)
    layout = inject.CodeLayout.of(code)
    assert code.stat().st_size < layout.code_span <= layout.data < layout.total_span
    assert os.access(helper, os.X_OK)


# -- slot writes are single stores ---------------------------------------------------------------

TEAR_C = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>
static volatile uint64_t *slot;
static volatile unsigned long torn, reads;
#define A 0x1122334455667788ULL
#define B 0x8877665544332211ULL
static void *reader(void *x) { (void)x; for (;;) { uint64_t v = *slot; reads++; if (v != A && v != B) torn++; } }
int main(void) {
    uint64_t *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    p[1] = A;
    mprotect(p, 4096, PROT_READ);          /* read-only, as a RELRO GOT */
    slot = &p[1];
    pthread_t t;
    pthread_create(&t, NULL, reader, NULL);
    printf("%lx\n", (unsigned long)(uintptr_t)slot);
    fflush(stdout);
    char line[8];
    if (!fgets(line, sizeof line, stdin)) return 2;
    printf("%lu %lu\n", reads, torn);
    return 0;
}
"""


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


FLIPS = 24_000      # compare-and-exchanges the slot test makes


def test_a_slot_write_is_seen_whole(tmp_path):
    """A thread loads a read-only slot in a loop while the recorder flips it between two values that
    differ in every byte, 256 compare-and-exchanges per stop, made by another thread of the process
    (Injection.store): no load ever sees a mix. Copies through /proc/PID/mem, measured alongside, are
    string moves that may tear (they did on AMD EPYC, 2026-11-27): placement never uses them for a
    word of the process."""
    exe = compile_c(_write(tmp_path, "tear.c", TEAR_C), tmp_path / "tear", "-pthread")
    a, b = 0x1122334455667788, 0x8877665544332211
    stops = 0

    def by_store(pid: int, addr: int, end: float) -> int:
        nonlocal stops
        inj = inject.inject(pid, 65536, 0)
        flips = [inject._Write(addr, a if i % 2 == 0 else b, b if i % 2 == 0 else a, after_ok=i > 0)
                 for i in range(inject.INJ_STORE_OPS)]
        writes = 0
        while writes < FLIPS and time.monotonic() < end:       # a count, not a time: a loaded machine
            writes += inj.store(flips)                         # takes longer, never fewer
            stops += 1
        inj.close()
        return writes

    def by_copy(pid: int, addr: int, end: float) -> int:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        writes = 0
        while time.monotonic() < end:
            for v in (b, a):
                os.pwrite(fd, struct.pack("<Q", v), addr)
            writes += 2
        os.close(fd)
        return writes

    writes, reads, torn = _flipped(exe, by_store, 120.0)
    copied, _, copy_torn = _flipped(exe, by_copy, 1.0)         # for the record: it depends on the CPU
    print(f"\n[slot writes] {_cpu()}: {writes} compare-and-exchanges in {stops} stops, {reads} concurrent loads, "
          f"{torn} torn; /proc/PID/mem copies: {copied} writes, {copy_torn} loads torn")
    assert writes == stops * inject.INJ_STORE_OPS and writes >= FLIPS and reads > 1_000_000 and torn == 0


def _flipped(exe: Path, flip, seconds: float) -> tuple[int, int, int]:
    """tear.c's slot flipped by `flip(pid, addr, end)` for `seconds`: (writes, loads, torn loads)."""
    p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        addr = int(p.stdout.readline(), 16)
        writes = flip(p.pid, addr, time.monotonic() + seconds)
        p.stdin.write("done\n")
        p.stdin.flush()
        reads, torn = map(int, p.stdout.readline().split())
    finally:
        p.kill()
        p.wait()
    return writes, reads, torn


# -- a workload that checks its own work ------------------------------------------------------------

@pytest.fixture(scope="module")
def stress(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("stress")
    exe = compile_c(WORKLOADS / "inject_stress.c", d / "inject_stress", "-pthread", "-ldl")
    lib = compile_c(WORKLOADS / "inject_lib.c", d / "libinject_lib.so", "-shared", "-fPIC")
    return exe, lib


class Stress:
    """A self-checking workload (inject_stress.c, py_stress.py), started and released;
    result() -> ("ok", checksum, signals, forks)."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.p.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.p.pid

    def go(self) -> None:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def release(self) -> None:
        """go, and stop after the first round (what closing stdin says): result() is that round's."""
        self.p.stdin.write("go\nstop\n")
        self.p.stdin.flush()

    def result(self, timeout: float = 120) -> list[str]:
        out, _ = self.p.communicate(timeout=timeout)
        assert self.p.returncode == 0, f"the workload failed (exit {self.p.returncode}): {out!r}"
        return out.split()


def _reference(argv: list[str], env: dict | None = None) -> str:
    return _unrecorded(argv, env).result()[1]


def _unrecorded(argv: list[str], env: dict | None = None) -> Stress:
    """The reference run (nothing placed into it), started and released: its first round's checksum
    is the recorded run's expected one (result()[1])."""
    s = Stress(argv, env)
    s.release()
    return s


CYCLER = """
import sys, time
from sampler.inprocess import inject, pydomains
inj = inject.inject(int(sys.argv[1]), 65536, 0, python_objects=True)
print("placed" if not inj.adopted else "adopted", flush=True)
py = cycles = 0
try:
    for i in range(int(sys.argv[2])):
        inj.redirect()
        py = max(py, len(inj.py_fields))    # CPython's allocator fields redirected
        time.sleep(0.002)
        inj.restore()
        cycles += 1
except (ProcessLookupError, inject.StoreFailed):
    pass                                    # the workload finished first (a loaded machine)
print("done", py, cycles, flush=True)
"""


def test_stress_keeps_its_checksum_through_redirects_restores_and_a_killed_recorder(stress):
    """8 threads, allocating signal handlers, forks, a dlopen midway, realloc/memalign mixes: 200
    redirect/restore cycles, a recorder killed with SIGKILL in the middle of its cycles, a second
    one adopting the sampler; the workload's checksum is the unrecorded run's and it never crashes."""
    argv = [str(stress[0]), "1500000", str(stress[1])]
    _cycle_through(argv, _unrecorded(argv))


@pytest.mark.parametrize(("mode", "iterations"), [("python", 6000), ("torch", 1200)])
def test_python_and_torch_keep_their_checksum_through_redirects_restores_and_a_killed_recorder(mode, iterations):
    """The same with CPython's object allocator redirected too: 8 Python threads (4 with torch ops)
    building and checking objects of every small size class, an allocating signal handler, forks,
    an extension module loaded midway; the checksum is the unrecorded run's."""
    argv = [sys.executable, str(WORKLOADS / "py_stress.py"), mode, str(iterations)]
    _cycle_through(argv, _unrecorded(argv))


def _cycle_through(argv: list[str], reference: Stress) -> None:
    """Runs the workload while a recorder cycles redirect/restore and is SIGKILLed midway, then a
    second adopts the sampler and cycles up to 200 times; checks the workload's own verdict, and
    its checksum against the `reference` run's (beside it: a Python workload holds one CPU, its GIL)."""
    try:
        _cycle_through_beside(argv, reference)
    finally:
        if reference.p.poll() is None:
            reference.p.kill()
            reference.p.wait()


def _cycle_through_beside(argv: list[str], reference: Stress) -> None:
    s = Stress(argv)
    s.go()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", CYCLER, str(s.pid), "100000"], stdout=subprocess.PIPE,
                             text=True, env=env)
    assert first.stdout.readline().strip() == "placed"
    time.sleep(0.5)                              # cycling
    first.kill()                                 # SIGKILL: some slots left redirected, some not
    first.wait()
    second = subprocess.run([sys.executable, "-c", CYCLER, str(s.pid), "200"], capture_output=True, text=True,
                            env=env, timeout=120)
    python = Path(argv[0]).name.startswith("python")
    said = second.stdout.split()
    assert said[:3] == ["adopted", "done", "8" if python else "0"] and int(said[3]) >= 1, second.stderr
    ok, checksum, signals, forks = s.result()
    expected = reference.result()[1]
    name = " ".join(Path(a).name for a in argv[:3])
    print(f"\n[stress] {name}: checksum {checksum} (expected {expected}), {signals} signal handlers, {forks} forks")
    assert ok == "ok" and checksum == expected and int(signals) > 0 and int(forks) > 0
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert inject.MEMFD_NAME not in maps          # the recorder placed nothing into itself


REDIRECTOR = """
import sys, time
from sampler.inprocess import inject
inj = inject.inject(int(sys.argv[1]), 65536, 0)
inj.redirect()
print(inj.allocator, flush=True)
time.sleep(120)
"""


def test_an_allocator_mapped_at_a_text_offset_is_forwarded_to_its_own_functions(stress):
    """jemalloc preloaded, the sampler placed before the workload first calls calloc, realloc or
    posix_memalign (their slots still lazy): each is forwarded to jemalloc's own definition (they
    were once off by the file offset of its text mapping, and the process crashed in jemalloc)."""
    env = {**os.environ, "LD_PRELOAD": JEMALLOC}
    argv = [str(stress[0]), "300000", str(stress[1])]
    expected = _reference(argv, env)
    s = Stress(argv, env)
    setter = subprocess.Popen([sys.executable, "-c", REDIRECTOR, str(s.pid)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert setter.stdout.readline().strip() == f"jemalloc:{JEMALLOC}"
        s.go()
        ok, checksum, _, _ = s.result()
        assert ok == "ok" and checksum == expected
    finally:
        setter.kill()
        setter.wait()


PY_SETTER = """
import sys, time
from sampler.inprocess import inject, pydomains
inj = inject.inject(int(sys.argv[1]), 65536, 0, python_objects=True)
inj.redirect()
print(len(inj.py_fields), flush=True)
time.sleep(60)
"""


def test_python_objects_are_opt_in_and_a_default_recorder_gives_their_allocator_back():
    """Without python_objects CPython's domains stay pymalloc's (optimised builds inline it only
    while it is theirs), and the process is told why; a default recorder that adopts a sampler whose
    domains an earlier recorder redirected (then was SIGKILLed) writes CPython's functions back."""
    s = Stress([sys.executable, str(WORKLOADS / "py_stress.py"), "python", "1500"])
    s.go()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", PY_SETTER, str(s.pid)], stdout=subprocess.PIPE, text=True,
                             env=env)
    assert first.stdout.readline().strip() == "8"    # malloc, calloc, realloc, free of two domains
    first.kill()
    first.wait()
    inj = inject.inject(s.pid, 65536, 0)
    assert inj.adopted
    inj.redirect()
    assert not inj.py_fields
    path, bias, doms, _ = inj.python
    ours = {inj.wrapper(f"py_{d}_{f}") for d in ("mem", "obj") for f in pydomains.FIELDS[1:]}
    with open(f"/proc/{s.pid}/mem", "rb") as mem:
        for d in ("mem", "obj"):
            mem.seek(bias + doms.get(d))
            fields = struct.unpack("<5Q", mem.read(40))
            assert not ours & set(fields[1:]), (d, [hex(v) for v in fields])
    assert any("are not sampled apart from malloc (--python-objects" in n for n in inj.news), inj.news
    inj.restore()
    ok, checksum, _, _ = s.result()
    assert ok == "ok", checksum


# -- the stopped thread ---------------------------------------------------------------------------

THREADS_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
/* A thread blocked in read(), one in nanosleep(), one computing in its registers: each must
 * come through any number of placements exactly as if nothing happened. */
static int fds[2];
static volatile int stop;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static void *reader(void *x) {
    char buf[16] = {0};
    ssize_t n = read(fds[0], buf, sizeof buf - 1);
    *(ssize_t *)x = n == 5 && buf[0] == 'h' && buf[4] == 'o' ? 1 : -1;
    return NULL;
}
static void *sleeper(void *x) {
    double t0 = now();
    struct timespec ts = {1, 500000000};
    nanosleep(&ts, NULL);
    *(double *)x = now() - t0;
    return NULL;
}
static void *spinner(void *x) {
    uint64_t a = 1, b = 2, c = 3, d = 4, n = 0;
    while (!stop) {
        for (int i = 0; i < 1000; i++) {
            a = a * 6364136223846793005ULL + b; b ^= a >> 7; c += a ^ d; d = c * 3 + n; n++;
        }
    }
    uint64_t e = 1, f = 2, g = 3, h = 4;    /* the same again, unstopped */
    for (uint64_t i = 0; i < n; i++) { e = e * 6364136223846793005ULL + f; f ^= e >> 7; g += e ^ h; h = g * 3 + i; }
    *(int *)x = a == e && b == f && c == g && d == h;
    return NULL;
}
int main(void) {
    if (pipe(fds)) return 2;
    ssize_t got = 0; double slept = 0; int same = 0;
    pthread_t r, s, p;
    pthread_create(&r, NULL, reader, &got);
    pthread_create(&s, NULL, sleeper, &slept);
    pthread_create(&p, NULL, spinner, &same);
    printf("ready\n"); fflush(stdout);
    char line[8];
    if (!fgets(line, sizeof line, stdin)) return 2;
    if (write(fds[1], "hello", 5) != 5) return 2;
    stop = 1;
    pthread_join(r, NULL); pthread_join(s, NULL); pthread_join(p, NULL);
    printf("%zd %.3f %d\n", got, slept, same);
    return 0;
}
"""


def _placing(pid: int) -> list[str]:
    """The helper's command line that places a sampler into `pid` (no configuration, no redirection)."""
    code, helper = inject.built()
    layout = inject.CodeLayout.of(code)
    return [str(helper), "place", str(pid), str(read_stat(pid).start), str(code), hex(layout.code_span),
            hex(layout.total_span)]


def test_placement_gives_each_thread_back_its_registers_and_its_system_call(tmp_path):
    """Placed 20 times into a process whose threads sleep in read() and nanosleep() and compute in
    their registers: the read gets its data, the sleep lasts its 1.5 s, the computation matches an
    uninterrupted one, and each placement stopped one thread for well under a second."""
    exe = compile_c(_write(tmp_path, "threads.c", THREADS_C), tmp_path / "threads", "-pthread", "-O2")
    p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        stops = []
        for _ in range(20):
            r = subprocess.run(_placing(p.pid), capture_output=True, text=True, timeout=30)
            assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout
            stops.append(int(r.stdout.split()[3]))
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        assert maps.count(inject.MEMFD_NAME) == 20
        p.stdin.write("go\n")
        p.stdin.flush()
        got, slept, same = p.stdout.readline().split()
    finally:
        p.kill()
        p.wait()
    stops.sort()
    print(f"\n[placement] one thread stopped: median {stops[10] / 1000:.0f} us, max {stops[-1] / 1000:.0f} us")
    assert got == "1" and float(slept) >= 1.5 and same == "1"
    assert stops[-1] < 1e9


SIGNALS_C = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
/* Counts SIGUSR1s by what their siginfo says: sigqueue's (SI_QUEUE, value 42), or anything else. */
static volatile sig_atomic_t good, bad;
static void on_usr1(int sig, siginfo_t *si, void *uc) {
    (void)sig; (void)uc;
    if (si->si_code == SI_QUEUE && si->si_value.sival_int == 42) good++; else bad++;
}
int main(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_usr1;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    printf("ready\n"); fflush(stdout);
    char line[8];
    if (!fgets(line, sizeof line, stdin)) return 2;
    printf("%d %d\n", (int)good, (int)bad);
    return 0;
}
"""


def test_signals_held_during_placement_keep_their_siginfo(tmp_path):
    """sigqueue()d signals (SI_QUEUE, a value) arrive while placements stop the thread: each is held
    and delivered again afterwards with its own siginfo, not as a plain kill."""
    import ctypes
    import threading
    exe = compile_c(_write(tmp_path, "signals.c", SIGNALS_C), tmp_path / "signals")
    libc = ctypes.CDLL(None, use_errno=True)
    p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stop = threading.Event()

    def send():
        while not stop.is_set():
            libc.sigqueue(p.pid, 10, ctypes.c_void_p(42))     # SIGUSR1
            time.sleep(0.0002)
    try:
        assert p.stdout.readline().strip() == "ready"
        sender = threading.Thread(target=send)
        sender.start()
        held = 0
        for _ in range(40):
            r = subprocess.run(_placing(p.pid), capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stdout
            held += int(r.stdout.split()[5])
        stop.set()
        sender.join()
        time.sleep(0.1)
        p.stdin.write("go\n")
        p.stdin.flush()
        good, bad = map(int, p.stdout.readline().split())
    finally:
        stop.set()
        p.kill()
        p.wait()
    print(f"\n[signals] {held} held during 40 placements; handler saw {good} with sigqueue's siginfo, {bad} without")
    assert held > 0 and good > 0 and bad == 0


def test_what_is_refused_says_why(tmp_path):
    static = compile_c(WORKLOADS / "static_alloc.c", tmp_path / "static_alloc", "-static")
    p = subprocess.Popen([str(static)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(inject.Refused, match="no dynamically linked malloc"):
            inject.inject(p.pid, 65536, 0)
    finally:
        p.kill()
        p.wait()
    # a process that a debugger traces is not touched
    target = subprocess.Popen(["sleep", "30"])
    tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(target.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout.readline().strip() == "tracing"
        with pytest.raises(inject.Refused, match="already traced"):
            inject.inject(target.pid, 65536, 0)
        assert "allocsampler" not in Path(f"/proc/{target.pid}/maps").read_text()
    finally:
        tracer.kill()
        target.kill()
        tracer.wait()
        target.wait()


TRACER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE = 0x4206
assert libc.ptrace(PTRACE_SEIZE, int(sys.argv[1]), 0, 0) == 0, ctypes.get_errno()
print("tracing", flush=True)
time.sleep(60)
"""


# -- recordings --------------------------------------------------------------------------------------

@pytest.mark.bpf
@pytest.mark.serial     # its 1.5 s recording saw no stack walked in BPF, twice in 3 suites, beside workers on both CPUs
def test_record_injects_by_default_and_matches_the_truth(workload, record):
    """`record --pid` on a process with no restart: the inject tier, its estimates within their
    standard errors of what the workload leaked, stacks as the uprobe tier gives them."""
    got = {}
    for mode in ("auto", "uprobe"):
        w = workload()
        rec = record("--pid", str(w.pid), "-i", "1", "--sample-bytes", "64K", "--attach-mode", mode)
        rec.wait_attached()
        leaked = w.call("leak_malloc", 4096, 4096) + w.call("leak_calloc", 512, 16384)
        w.call("churn", 8192, 4096)
        time.sleep(1.5)
        code, _, err = rec.stop()
        assert code == 0, err
        from analysis.dataset import read_table
        procs = read_table(rec.out, "processes")
        tiers = set(procs[procs["pid"] == w.pid]["tier"])
        assert tiers == ({"inject"} if mode == "auto" else {"attach"}), tiers
        df = final_by_site(rec.out, w.pid)
        got[mode] = df.groupby("site_fn")[["outstanding_bytes", "outstanding_stderr_bytes"]].sum()
        for site, truth in (("leak_malloc", 4096 * 4096), ("leak_calloc", 512 * 16384)):
            est, se = got[mode].loc[site]
            assert abs(est - truth) < 4 * se + 0.02 * truth, (mode, site, est, se, truth)
        assert leaked > 0
        targets = read_table(rec.out, "targets")
        if mode == "auto":
            assert targets["detail"].str.contains("inject: in-process sampler at").any()
            # placed beside the loop, the sampler's code still joins the process's unwind tables
            walks = read_table(rec.out, "recorder")[["stacks_in_bpf", "stacks_handed_over"]].sum()
            assert walks["stacks_in_bpf"] > 4 * walks["stacks_handed_over"], walks.to_dict()
    assert set(got["auto"].index) & {"leak_malloc", "leak_calloc"} == set(got["uprobe"].index) & {
        "leak_malloc", "leak_calloc"}


def test_function_pointers_a_library_keeps_to_malloc_are_redirected_too(tmp_path, gated, record, bpf_ready):
    """A library allocating through `void *(*lib_malloc)(size_t) = malloc;` (libxml2's xmlMalloc,
    jansson's do_malloc), in a PIE program: the word, filled with libc's malloc by an R_X86_64_64
    relocation at load, is redirected like a GOT slot, so its leak is found at the default tier at
    the size it has; its frees are seen (the churn through `lib_free` leaves nothing outstanding)."""
    lib = compile_c(WORKLOADS / "fnptr_lib.c", tmp_path / "libfnptr.so", "-shared", "-fPIC")
    exe = compile_c(WORKLOADS / "fnptr_main.c", tmp_path / "fnptr_main", "-pie", "-fPIE", "-Wl,--no-as-needed",
                    str(lib), f"-Wl,-rpath,{tmp_path}")
    t = gated([str(exe)], ready="ready")
    rec = record("--pid", str(t.pid), "-i", "1", "--sample-bytes", "64K")
    rec.wait_attached()
    t.go()
    leaked = int(t.line())
    rec.wait_snapshot(time.time() + 1.2)
    code, _, err = rec.stop()
    assert code == 0, err
    from analysis.dataset import read_table
    procs = read_table(rec.out, "processes")
    assert set(procs["tier"].astype(str)) == {"inject"}, procs["tier"]
    df = final_by_site(rec.out, t.pid)
    by = df.groupby("site_fn")[["outstanding_bytes", "outstanding_stderr_bytes"]].sum()
    est, se = by.loc["fnptr_leak"] if "fnptr_leak" in by.index else (0.0, 0.0)
    assert abs(est - leaked) < 4 * se + 0.05 * leaked, (est, se, leaked, by)
    assert "fnptr_churn" not in by.index or by.loc["fnptr_churn", "outstanding_bytes"] < 0.05 * leaked, by


def test_the_decoder_runs_as_a_uid_no_process_has():
    """CPython's code is decoded as a uid of its own: not nobody's (a recorded process may be nobody
    and could stop or trace the decoder), and not one any process runs as."""
    from sampler.inprocess import pydomains
    first = pydomains.decoder_uid()
    assert first in pydomains.DYNAMIC_UIDS and first != pydomains.NOBODY

    def become() -> None:
        os.setresgid(first, first, first)
        os.setresuid(first, first, first)
    squatter = subprocess.Popen(["sleep", "30"], preexec_fn=become)
    try:
        time.sleep(0.1)
        assert pydomains.decoder_uid() not in (first, pydomains.NOBODY)
    finally:
        squatter.kill()
        squatter.wait()


def _write(d: Path, name: str, text: str) -> Path:
    p = d / name
    p.write_text(text)
    return p


# -- CPython's object allocator ----------------------------------------------------------------------

def _pythons() -> list[str]:
    """Debian's CPython (statically linked: its domains are file-static in 3.11) and the newest pyenv
    build where there is one (shared libpython: _PyRuntime reached through the GOT)."""
    import glob
    found = ["/usr/bin/python3.11"] + sorted(glob.glob("/root/.pyenv/versions/3.1[2-9].*/bin/python3"))[-1:]
    return [p for p in found if os.access(p, os.X_OK)]


def test_cpythons_allocator_domains_are_found_in_its_code():
    """pydomains finds raw, mem and obj on every CPython here (3.6-3.13: statics or _PyRuntime),
    where the interpreter itself says they are: PyMem_GetAllocator's answer, read back in-process."""
    import glob

    libs = ["/usr/bin/python3.11", *glob.glob("/root/.pyenv/versions/3.*/lib/libpython3.*.so.1.0")]
    for path in libs:
        doms = pydomains.locate(path)
        assert doms is not None, path
        assert len({doms.raw, doms.mem, doms.obj}) == 3, path
    # this interpreter (the venv's): the obj domain's malloc field holds what PyMem_GetAllocator says
    probe = r"""
import ctypes, os, struct, sys
from sampler.inprocess import pydomains
from sampler.proc.maps import read_maps
class A(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("ctx", "malloc", "calloc", "realloc", "free")]
a = A()
ctypes.pythonapi.PyMem_GetAllocator(2, ctypes.byref(a))      # PYMEM_DOMAIN_OBJ
exe = os.path.realpath(sys.executable)
m = next(m for m in read_maps(os.getpid()) if m.path == exe and m.offset == 0)
doms = pydomains.locate(exe)
from sampler.binary.reader import ElfReader, PT_LOAD
first = min(s.vaddr for s in ElfReader.open(exe).segments if s.type == PT_LOAD) & ~0xFFF
got = ctypes.c_uint64.from_address(m.start - first + doms.obj + 8).value
print(got == a.malloc, flush=True)
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.stdout.strip() == "True", r.stdout + r.stderr


@pytest.mark.bpf
@pytest.mark.parametrize("python", _pythons(), ids=lambda p: p.split("/")[-3] if "pyenv" in p else "debian")
@pytest.mark.parametrize("pymalloc", [True, False], ids=["pymalloc", "PYTHONMALLOC=malloc"])
def test_python_objects_are_their_own_source_and_match_the_truth(gated, record, python, pymalloc):
    """Small objects, which never reach malloc, are sampled in CPython's object allocator: source
    `python`, Python stacks, estimates within their standard errors of the workload's own count.
    Under PYTHONMALLOC=malloc the same objects are malloc's, sampled there, never twice."""
    import json

    from analysis.dataset import latest_outstanding, read_table
    env = {} if pymalloc else {"PYTHONMALLOC": "malloc"}
    t = gated([python, str(WORKLOADS / "py_objects.py"), "200000"], ready="ready", stream="stdout", env=env)
    rec = record("--pid", str(t.pid), "-i", "1", "--sample-bytes", "32K", "--python-objects")  # default rate cap
    rec.wait_attached()
    deadline = time.monotonic() + 30
    note = "CPython objects sampled" if pymalloc else "not sampled apart from malloc (PYTHONMALLOC=malloc)"
    while not read_table(rec.out, "targets")["detail"].str.contains(note, regex=False).any():
        assert time.monotonic() < deadline, read_table(rec.out, "targets").to_string()
        time.sleep(0.1)
    time.sleep(1.0)                              # Python detection and the thread walk
    t.go()
    truth = json.loads(t.line())
    rec.wait_snapshot(time.time() + 1.2)
    code, _, err = rec.stop()
    assert code == 0, err
    assert read_table(rec.out, "recorder")["lost_events"].sum() == 0
    df = latest_outstanding(rec.out, [t.pid])
    frames = read_table(rec.out, "frames")
    py = frames[frames["kind"] == "python"]
    est = {}
    for site in truth:
        ids = set(py[py["function"] == site]["stack_id"])
        rows = df[df["stack_id"].isin(ids) & (df["source"] != "mmap")]   # mmap: glibc's big list arrays again
        est[site] = rows.groupby("source", observed=True)[["outstanding_bytes"]].sum()["outstanding_bytes"].to_dict()
        var = float((rows["outstanding_stderr_bytes"] ** 2).sum())
        total = sum(est[site].values())
        assert abs(total - truth[site]) <= 4 * var ** 0.5 + 0.03 * truth[site] + 64 * 1024, (site, est[site], truth)
    # small objects are `python` (pymalloc's arenas not counted again as mmap), unless PYTHONMALLOC
    # makes them malloc's; their lists' arrays and objects over 512 bytes are malloc's
    for site in ("leak_small", "leak_tuples"):
        assert est[site].get("python", 0) > 0.5 * truth[site] if pymalloc else "python" not in est[site], est
    # the only mmaps are glibc's for the lists' arrays (2 MiB): pymalloc's arenas (34 MiB) are not
    # counted again
    mm = df[df["source"] == "mmap"]
    assert mm["outstanding_bytes"].sum() < 4 * MiB, mm
    # objects over 512 bytes are malloc's (the site's total is checked above, against its standard
    # error); python's there can only be the list's own header, one sample at most
    assert est["leak_large"].get("python", 0) <= 64 * 1024 < est["leak_large"].get("malloc", 0), est
    # churned objects' frees are reported (~1,400 samples, freed): none is left outstanding
    assert sum(est["churn"].values()) <= 64 * 1024, est
    print(f"\n[python objects] {python} {'pymalloc' if pymalloc else 'malloc'}: "
          + ", ".join(f"{s} {sum(est[s].values()) / MiB:.2f}/{truth[s] / MiB:.2f} MiB" for s in truth))
